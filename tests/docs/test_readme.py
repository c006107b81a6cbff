"""The user docs hold to what they promise: the README is short, starts with a plain
`/v1/chat/completions` call, names `make test` and links only to what exists; the Python API
page's example runs as written, on the bundled model, and uses only the public face
(`from prepos import ...`); the options page is what `scripts/options_page.py` makes from
`prepos serve`'s parser, today."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PYTHON_PAGE = ROOT / "docs" / "python.md"
OPTIONS_PAGE = ROOT / "docs" / "options.md"
PATHS = {"fast", "fall-through", "cold"}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def example() -> str:
    blocks = [b for b in python_blocks(PYTHON_PAGE.read_text()) if "from prepos import" in b]
    assert blocks, "docs/python.md has no ```python block importing from prepos"
    return blocks[0]


def test_example_uses_the_public_face_only():
    code = example()
    assert not re.search(r"^\s*(from|import)\s+prepos\.", code, re.M), (
        "the Python API page's example imports internals:\n" + code)


def test_example_runs_as_written():
    proc = subprocess.run([sys.executable, "-c", example()], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"docs/python.md's example failed:\n{proc.stderr[-4000:]}"
    words = proc.stdout.split()
    # it prints the first answer's path first and the streamed answer's path last
    assert words and words[0] in PATHS, proc.stdout
    assert words[-1] in PATHS, proc.stdout


def options_page():
    spec = importlib.util.spec_from_file_location("options_page",
                                                  ROOT / "scripts" / "options_page.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_options_page_is_current():
    made = options_page().page()
    assert OPTIONS_PAGE.is_file() and OPTIONS_PAGE.read_text() == made, \
        "docs/options.md is not what the parser makes: run scripts/options_page.py"


def test_the_options_page_names_every_serve_option():
    from prepos.server.http.options import parser

    flags = [f for a in parser()._actions for f in a.option_strings
             if f.startswith("--") and f != "--help"]
    text = OPTIONS_PAGE.read_text()
    assert len(flags) > 40 and [f for f in flags if f"`{f}`" not in text] == []


def test_the_options_pages_environment_variables_are_read():
    """Each variable the page names is one the server reads (a string in its source)."""
    names = set(re.findall(r"`(PREPOS_[A-Z_]+)`", OPTIONS_PAGE.read_text()))
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "prepos").rglob("*.py"))
    assert names and [n for n in names if f'"{n}"' not in source] == []


def test_the_readme_is_short_and_starts_with_a_plain_chat_call():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    quick = text.split("\n## Quick start\n", 1)[1]
    first = re.search(r"^```\w*\n(.*?)^```", quick, re.M | re.S).group(1)
    assert "/v1/chat/completions" in first and "session_id" not in first, first
    assert "make test" in text


def test_the_readmes_links_resolve():
    text = README.read_text()
    links = [t.split("#", 1)[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)
             if "://" not in t and not t.startswith("#")]
    assert links and [t for t in links if not (ROOT / t).exists()] == []
