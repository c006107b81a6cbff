"""`prepos demo --url` against a real server, as the README runs it: the bundled model (its
relaxed fast answers are bodies of known length, read to their end), a server that wants a
key (`--api-key`), and `--seed`/`--updates` taken (they choose the questions and the rows)."""

from __future__ import annotations

import pytest

from prepos.lab import demo
from prepos.paths import DEFAULT_MODEL
from tests.support.server_harness import ServerProc

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(),
                                reason="the bundled model is not trained (prepos train)")
KEY = "demo-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProc(DEFAULT_MODEL, tmp_path_factory.mktemp("srv-demo"), "--api-key",
                    KEY) as srv:
        yield srv


def rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line[:3].strip().isdigit()]


def test_demo_against_a_server_with_a_key(server, capsys):
    assert demo.main(["--url", server.url, "--api-key", KEY, "--updates", "2",
                      "--seed", "3"]) == 0
    first = rows(capsys.readouterr().out)
    assert len(first) == 2 * 3 + 3  # three rows per update, three agentic rows
    assert demo.main(["--url", server.url, "--api-key", KEY, "--updates", "1",
                      "--seed", "7"]) == 0
    second = rows(capsys.readouterr().out)
    assert len(second) == 3 + 3  # --updates taken
    assert first[1].split()[3:6] != second[1].split()[3:6]  # --seed picks the question
    assert demo.main(["--url", server.url, "--api-key", "wrong", "--updates", "1"]) == 1
