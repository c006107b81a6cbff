"""The docs build as a site: `mkdocs build --strict` passes (no broken link or anchor, every
page in the nav), as CI runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_build_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the test extra has it)")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "options" / "index.html").is_file()


def test_every_page_is_in_the_nav():
    """A page under docs/ that the nav leaves out is one no reader finds."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (mkdocs needs it)")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav) -> list[str]:
        out = []
        for item in nav:
            for value in (item.values() if isinstance(item, dict) else [item]):
                out += pages(value) if isinstance(value, list) else [value]
        return out

    assert sorted(pages(config["nav"])) == sorted(
        p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
