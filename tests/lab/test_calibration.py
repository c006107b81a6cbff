"""Calibration: Wilson intervals, the tau sweep, choosing tau, the false-accept split."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prepos.backends import llama_cpp
from prepos.core import AnswerPath, Match, ReadyRecord, Result
from prepos.decode.stream import Stream
from prepos.lab import calibration as cal
from prepos.lab.task.market import decision_points
from tests.support.models import NO_LLAMA_CPP

NEEDS_LLAMA_CPP = pytest.mark.skipif(not llama_cpp.available(), reason=NO_LLAMA_CPP)

# -- Wilson intervals ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "k, n, lo, hi",
    [
        (5, 10, 0.2366, 0.7634),  # textbook value for p = 0.5, n = 10
        (0, 10, 0.0, 0.2775),
        (10, 10, 0.7225, 1.0),
        (121, 128, 0.891, 0.973),  # the reference's coverage at tau = 2.0: [0.89, 0.97]
        (16, 121, 0.083, 0.204),  # the reference's false-accept rate: [0.083, 0.204]
    ],
)
def test_wilson_known_values(k, n, lo, hi):
    got = cal.wilson(k, n)
    assert got[0] == pytest.approx(lo, abs=6e-4)
    assert got[1] == pytest.approx(hi, abs=6e-4)


def test_wilson_edge_cases():
    assert cal.wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        cal.wilson(3, 2)
    with pytest.raises(ValueError):
        cal.wilson(-1, 2)


@given(st.integers(0, 500).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_wilson_contains_the_estimate_and_is_symmetric(kn):
    k, n = kn
    lo, hi = cal.wilson(k, n)
    assert 0.0 <= lo <= hi <= 1.0
    if n:
        assert lo - 1e-12 <= k / n <= hi + 1e-12
        lo2, hi2 = cal.wilson(n - k, n)
        assert lo == pytest.approx(1 - hi2, abs=1e-12)
        assert hi == pytest.approx(1 - lo2, abs=1e-12)


# -- sweep --------------------------------------------------------------------------------


def pair(gap: float, token: str = "up", full: str = "up", truth: str | None = None,
         in_answers: bool = True, prob: float = 0.9, kind: str = "trend") -> cal.Pair:
    truth = full if truth is None else truth
    return cal.Pair(0, 0, "ACME", truth, kind, kind, "q?", truth, gap, token, in_answers, full,
                    prob)


pairs_st = st.lists(
    st.builds(
        pair,
        gap=st.floats(0, 20, allow_nan=False),
        token=st.sampled_from(["up", "down", "flat", "the"]),
        full=st.sampled_from(["up", "down", "flat"]),
        in_answers=st.booleans(),
    ),
    min_size=1,
    max_size=60,
)


@given(pairs_st, st.lists(st.floats(0, 25, allow_nan=False), min_size=2, max_size=20))
def test_sweep_coverage_is_monotone_non_increasing(pairs, taus):
    curve = cal.sweep(pairs, sorted(taus))
    for a, b in zip(curve, curve[1:]):
        assert b.coverage <= a.coverage
        assert b.accepted <= a.accepted
    for pt in curve:
        assert 0 <= pt.false_accepts <= pt.accepted <= pt.n == len(pairs)
        assert pt.coverage_ci[0] <= pt.coverage <= pt.coverage_ci[1]
        if pt.accepted:
            assert pt.false_accept == pt.false_accepts / pt.accepted
        else:
            assert pt.false_accept is None


def test_sweep_on_a_hand_made_set():
    pairs = [
        pair(0.5, "up", "down"),  # small gap, disagrees
        pair(1.5, "up", "up"),
        pair(3.0, "down", "up"),  # large gap, disagrees (a divergence)
        pair(5.0, "flat", "flat"),
        pair(9.0, "the", "up", in_answers=False),  # argmax outside A: never served
    ]
    c = {pt.tau: pt for pt in cal.sweep(pairs, [0.0, 1.0, 2.0, 4.0, 6.0])}
    assert [c[t].accepted for t in (0.0, 1.0, 2.0, 4.0, 6.0)] == [4, 3, 2, 1, 0]
    assert c[0.0].coverage == 0.8 and c[0.0].false_accept == 0.5
    assert c[1.0].false_accept == pytest.approx(1 / 3)
    assert c[2.0].false_accept == 0.5
    assert c[4.0].false_accept == 0.0
    # the gate is strict: gap > tau
    assert cal.at(pairs, 1.5).accepted == 2


def test_choose_tau_is_the_smallest_within_budget():
    pairs = [pair(0.5, "up", "down"), pair(1.5), pair(3.0, "down", "up"), pair(5.0), pair(6.0)]
    curve = cal.sweep(pairs, cal.tau_grid(pairs, step=0.5))
    # r(tau): 0.4 at 0, 0.25 on (0.5, 1.5), 1/3 on [1.5, 3), 0 from 3
    assert cal.choose_tau(curve, r_max=0.2).tau == 3.0
    assert cal.choose_tau(curve, r_max=0.25).tau == 0.5
    assert cal.choose_tau(curve, r_max=0.25, tau_min=1.0).tau == 1.0
    assert cal.choose_tau(curve, r_max=0.25, tau_min=2.0).tau == 3.0
    assert cal.choose_tau(curve, r_max=0.4).tau == 0.0
    none = [pair(1.0, "up", "down")]
    assert cal.choose_tau(cal.sweep(none, [0.0, 0.5, 2.0]), r_max=0.1) is None


def test_tau_grid_covers_every_gap():
    pairs = [pair(0.3), pair(7.26)]
    grid = cal.tau_grid(pairs, step=0.25)
    assert grid[0] == 0.0 and grid[-1] > 7.26
    assert cal.at(pairs, grid[-1]).accepted == 0


def test_decompose_false_accepts():
    pairs = [
        pair(5.0, "up", "down", truth="up"),  # full path wrong: unsure
        pair(5.0, "up", "down", truth="down", prob=0.4),  # right but below 0.5: unsure
        pair(5.0, "up", "down", truth="down", prob=0.99, kind="wording"),  # divergence
        pair(5.0, "up", "up"),  # agrees: not a false accept
        pair(0.2, "up", "down"),  # not accepted
    ]
    d = cal.decompose(pairs, tau=1.0)
    assert d == {
        "false_accepts": 3,
        "full_path_unsure": 2,
        "pre_commitment_divergence": 1,
        "by_query_kind": {"trend": 2, "wording": 1},
    }


def test_accuracy_against_ground_truth():
    pairs = [pair(5.0, "up", "up", truth="up"), pair(0.1, "down", "flat", truth="flat"),
             pair(5.0, "down", "up", truth="up")]
    acc = cal.accuracy(pairs, tau=1.0)
    assert acc["full_path"]["k"] == 3
    assert acc["served"]["k"] == 2  # the fast path served "down" on the third
    assert acc["fast_path_when_fired"] == {"k": 1, "n": 2, "rate": 0.5, "ci": cal.wilson(1, 2)}


# -- measuring through an engine ----------------------------------------------------------


class FakeEngine:
    """The part of the Engine API `measure` uses; answers from a lookup of the window."""

    def __init__(self, header: dict[str, tuple[str, float]], full: dict[str, str]):
        self.header, self.full = header, full
        self.ids = {"up": 1, "down": 2, "flat": 3, "yes": 4, "no": 5, "the": 9}
        self.gate = type("G", (), {"answer_ids": frozenset({1, 2, 3, 4, 5})})()
        self.sessions: dict[str, list[str]] = {}
        self.closed: list[str] = []

    def create_session(self, kind, system=None, fast_path="exact", **kw):
        assert kind == "streaming" and fast_path == "relaxed"
        sid = f"s{len(self.sessions)}"
        self.sessions[sid] = []
        return sid

    def append(self, sid, text):
        self.sessions[sid].append(text)

    def wait_idle(self, timeout=None):
        return True

    def ready_header(self, sid):
        tok, gap = self.header[self.sessions[sid][-1]]
        logits = torch.zeros(10)
        return ReadyRecord(p=1, entry=(), logits=logits, top_ids=(self.ids[tok], 0),
                           top_logprobs=(0.0, -gap), gap=gap, version=1, top_text=tok)

    def query(self, sid, question, req):
        assert req.fast_path == "off" and req.sampling.max_tokens == 1
        ans = self.full[self.sessions[sid][-1]]
        res = Result(AnswerPath.COLD, Match.NONE, tokens=[self.ids[ans]], text=ans,
                     logprobs=[math.log(0.8)])
        stream = Stream()
        stream.finish(res)
        return stream

    def close_session(self, sid):
        self.closed.append(sid)


def test_measure_records_header_and_full_path_per_window():
    dps = decision_points(6, seed=77, wording_rate=0.0)
    header = {dp.messages[-1]: (dp.trend, 3.0 + i) for i, dp in enumerate(dps)}
    header[dps[0].messages[-1]] = ("the", 9.0)
    full = {dp.messages[-1]: dp.trend for dp in dps}
    eng = FakeEngine(header, full)
    pairs = cal.measure(eng, dps)
    assert len(pairs) == 6 and len(eng.closed) == 6
    assert [len(v) for v in eng.sessions.values()] == [len(dps[0].messages)] * 6
    assert not pairs[0].in_answers and all(p.in_answers for p in pairs[1:])
    assert all(p.agrees for p in pairs[1:])
    assert pairs[2].gap == 5.0 and pairs[2].full_prob == pytest.approx(0.8)
    summary = cal.summarize(pairs, r_max=0.15, tau_min=1.0, reference_tau=None)
    assert summary["tau"] == 1.0 and summary["operating_point"]["coverage"] == pytest.approx(5 / 6)
    assert summary["budget_met"]


def test_calibrate_cli_on_the_bundled_models(tmp_path):
    """`prepos calibrate` end to end on a few decision points, without touching the models."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "models"
    before = (root / "trend-reader" / "gate.json").read_text()
    rc = cal.main(["--models", str(root / "trend-reader"), str(root / "trend-reader-weak"),
                   "--n", "12", "--out", str(tmp_path), "--no-write-gate", "--no-figures"])
    assert rc == 0
    out = json.loads((tmp_path / "calibration.json").read_text())
    assert set(out["models"]) == {"trend-reader", "trend-reader-weak"}
    strong, weak = out["models"]["trend-reader"], out["models"]["trend-reader-weak"]
    assert len(strong["pairs"]) == 12 and strong["tau"] >= 1.0
    assert strong["gap"]["median"] > weak["gap"]["max"]
    assert weak["at_reference_tau"]["accepted"] == 0
    assert (root / "trend-reader" / "gate.json").read_text() == before


def _packaged_gguf(tmp_path, monkeypatch):
    """The bundled trend-reader as a GGUF inside an importable package, known by an alias
    (as `smollm2` is: a GGUF shipped in an installed package)."""
    import importlib
    import shutil
    from pathlib import Path

    from prepos.engine import loading

    root = Path(__file__).resolve().parents[2] / "models"
    pkg = tmp_path / "site" / "prepos_test_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    gguf = pkg / "Trend-Reader-0.9M.Q8_0.gguf"
    shutil.copy(loading.exported_gguf(root / "trend-reader"), gguf)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setitem(loading.ALIASES, "packaged-reader",
                        ("prepos_test_gguf_pkg", "pip install prepos-test-gguf-pkg"))
    return gguf


@NEEDS_LLAMA_CPP
def test_calibrate_cli_resolves_an_alias_without_writing_into_its_package(tmp_path, monkeypatch):
    import json

    gguf = _packaged_gguf(tmp_path, monkeypatch)
    out = tmp_path / "out"
    rc = cal.main(["--models", "packaged-reader", "--n", "3", "--out", str(out),
                   "--no-figures", "--threads", "1"])  # gate writing left on
    assert rc == 0
    assert not (gguf.parent / "gate.json").exists()
    res = json.loads((out / "calibration.json").read_text())
    assert list(res["models"]) == ["Trend-Reader-0.9M"]  # the stem less its quantization tag
    model = res["models"]["Trend-Reader-0.9M"]
    assert model["model_file"] == str(gguf) and "gate_written" not in model
    assert len(model["pairs"]) == 3 and model["header_tokens"]


@NEEDS_LLAMA_CPP
def test_calibrate_writes_the_gate_beside_a_gguf_the_user_names(tmp_path, monkeypatch):
    import json
    import shutil

    packaged = _packaged_gguf(tmp_path, monkeypatch)
    mine = tmp_path / "mine" / "reader.gguf"
    mine.parent.mkdir()
    shutil.copy(packaged, mine)
    assert cal.gate_home(mine) == mine.parent
    rc = cal.main(["--models", str(mine), "--n", "3", "--out", str(tmp_path / "out"),
                   "--no-figures", "--threads", "1"])
    assert rc == 0
    gate = json.loads((mine.parent / "gate.json").read_text())
    assert gate["answers"] == list(cal.ANSWERS) and gate["tau"] >= 1.0


def test_gate_home_refuses_an_installed_package_even_by_path(tmp_path, monkeypatch):
    import sysconfig

    gguf = _packaged_gguf(tmp_path, monkeypatch)
    assert cal.gate_home("packaged-reader") is None
    assert cal.gate_home(gguf) == gguf.parent  # not under site-packages: the user's
    real = sysconfig.get_paths
    site = str(tmp_path / "site")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {**real(), "purelib": site})
    assert cal.gate_home(gguf) is None  # by path, but inside an installed package's folder


def test_calibrate_cli_refuses_an_unknown_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cal.main(["--models", str(tmp_path / "nothing-here"), "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "neither a model directory" in capsys.readouterr().err
    assert not (tmp_path / "calibration.json").exists()
