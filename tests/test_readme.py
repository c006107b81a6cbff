"""The README's Python API example runs as written, on the bundled model, and uses only the
public face (`from prepos import ...`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PATHS = {"fast", "fall-through", "cold"}


def section(text: str, heading: str) -> str:
    """The README's text under `## heading`, up to the next `## ` heading."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {heading}' section"
    return m.group(1)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def example() -> str:
    blocks = [b for b in python_blocks(section(README.read_text(), "The Python API"))
              if "from prepos import" in b]
    assert blocks, "the Python API section has no ```python block importing from prepos"
    return blocks[0]


def test_example_uses_the_public_face_only():
    code = example()
    assert not re.search(r"^\s*(from|import)\s+prepos\.", code, re.M), (
        "the README's Python example imports internals:\n" + code)


def test_example_runs_as_written():
    proc = subprocess.run([sys.executable, "-c", example()], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"the README's Python example failed:\n{proc.stderr[-4000:]}"
    words = proc.stdout.split()
    # it prints the first answer's path first and the streamed answer's path last
    assert words and words[0] in PATHS, proc.stdout
    assert words[-1] in PATHS, proc.stdout


def test_every_serve_option_is_in_the_readme():
    from prepos.server.http.options import parser

    flags = [f for a in parser()._actions for f in a.option_strings
             if f.startswith("--") and f != "--help"]
    text = README.read_text()
    assert len(flags) > 40 and [f for f in flags if f"`{f}" not in text] == []
