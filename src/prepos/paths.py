"""Where things live: the repository root (a source checkout or an editable install), and
the bundled models in `models/` under it."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
DEFAULT_MODEL = MODELS / "trend-reader"
WEAK_MODEL = MODELS / "trend-reader-weak"
