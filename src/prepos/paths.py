"""Where the bundled models live: `models/` at the repository root."""

from pathlib import Path

MODELS = Path(__file__).resolve().parents[2] / "models"
DEFAULT_MODEL = MODELS / "trend-reader"
WEAK_MODEL = MODELS / "trend-reader-weak"
