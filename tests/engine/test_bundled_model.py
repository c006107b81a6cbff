"""The bundled models: shipped, loadable through the engine, and (the default) decisive."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prepos.config import EngineConfig, GateConfig
from prepos.core import AnswerPath, Request, SamplingParams
from prepos.lab.task.market import ANSWERS, SYSTEM_PROMPT, format_data

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "models" / "trend-reader"
WEAK = ROOT / "models" / "trend-reader-weak"
MODELS = [DEFAULT, WEAK]

RISING = [[31, 32, 34, 35, 37, 38], [40, 41, 43, 44, 46, 48], [49, 51, 52, 54, 55, 57],
          [58, 60, 61, 63, 65, 66]]
FALLING = [[p_ for p_ in reversed(m)] for m in reversed(RISING)]
FLAT = [[50, 51, 50, 49, 50, 50], [51, 50, 49, 50, 51, 50], [50, 49, 50, 51, 50, 50],
        [49, 50, 51, 50, 50, 49]]


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.name)
def test_model_directory_is_complete_and_small(path):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "gate.json"):
        assert (path / f).is_file(), f
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    assert size < 20 * 2**20
    gate = GateConfig.load(path / "gate.json")
    assert set(gate.answers) == set(ANSWERS) and gate.tau > 0
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.name)
def test_tokenizer_meets_the_engine_requirements(path):
    from transformers import AutoTokenizer

    from prepos.lab.task.tokenizer import check

    check(AutoTokenizer.from_pretrained(str(path), local_files_only=True))


@pytest.fixture(scope="module")
def engine():
    from prepos.engine import Engine

    eng = Engine.from_pretrained(DEFAULT, EngineConfig())  # gate from the bundled gate.json
    yield eng
    eng.close()


def _session(eng, ticker: str, series: list[list[int]]) -> str:
    sid = eng.create_session("streaming", system=SYSTEM_PROMPT, fast_path="relaxed")
    for prices in series:
        eng.append(sid, format_data(ticker, prices))
    eng.wait_idle()
    return sid


@pytest.mark.parametrize("series, trend", [(RISING, "up"), (FALLING, "down"), (FLAT, "flat")])
def test_default_model_answers_the_trend_on_the_fast_path(engine, series, trend):
    sid = _session(engine, "ACME", series)
    try:
        rec = engine.ready_header(sid)
        assert rec is not None and rec.top_text.strip() == trend
        assert rec.gap > engine.gate.tau
        # a new class (and a trend new to it) is answered by the full path, its answers the
        # evidence, until that evidence lets the fast path serve it
        for _ in range(engine.config.relaxed.min_verified + 1):
            res = engine.query(sid, "Which way is ACME moving?",
                               Request(SamplingParams(max_tokens=1))).result()
            engine.wait_idle()
            if res.path == AnswerPath.FAST:
                break
        assert res.path == AnswerPath.FAST
        assert res.text.strip() == trend
        # the full path agrees, and answers a polar question in its own format
        full = engine.query(sid, "Which way is ACME moving?",
                            Request(SamplingParams(max_tokens=1), fast_path="off")).result()
        assert full.path != AnswerPath.FAST and full.text.strip() == trend
        polar = engine.query(sid, "Is ACME rising?",
                             Request(SamplingParams(max_tokens=1), fast_path="off")).result()
        assert polar.text.strip() in ("yes", "no")
    finally:
        engine.close_session(sid)


def test_default_model_full_path_ends_its_answer(engine):
    sid = _session(engine, "BOLT", RISING)
    try:
        res = engine.query(sid, "What is the trend of BOLT?",
                           Request(SamplingParams(max_tokens=4), fast_path="off")).result()
        assert res.text.strip() == "up" and res.finish_reason in ("eos", "stop")
    finally:
        engine.close_session(sid)


def test_weak_model_gate_does_not_fire():
    from prepos.engine import Engine

    tau = GateConfig.load(DEFAULT / "gate.json").tau
    cfg = EngineConfig(gate=GateConfig(tau=tau, answers=ANSWERS))
    with Engine.from_pretrained(WEAK, cfg) as eng:
        for series in (RISING, FALLING):
            sid = _session(eng, "ACME", series)
            rec = eng.ready_header(sid)
            assert rec is not None and rec.gap < tau
            res = eng.query(sid, "Which way is ACME moving?",
                            Request(SamplingParams(max_tokens=1))).result()
            assert res.path != AnswerPath.FAST
            assert res.text.strip() in ANSWERS
            eng.close_session(sid)


def test_tokenizer_is_rebuilt_identically_from_the_task(tmp_path):
    from prepos.lab.task.tokenizer import build

    build(tmp_path)
    ours = json.loads((tmp_path / "tokenizer.json").read_text())
    shipped = json.loads((DEFAULT / "tokenizer.json").read_text())
    assert ours["model"]["vocab"] == shipped["model"]["vocab"]
    assert ours["model"]["merges"] == shipped["model"]["merges"]


def test_training_is_seeded_and_saves_an_engine_loadable_model(tmp_path):
    """A two-step run of `prepos train` (the recipe itself takes minutes): same seed, same
    weights; the directory loads through the engine and answers in the task's vocabulary."""
    from safetensors.torch import load_file

    from prepos.engine import Engine
    from prepos.lab.train import main

    args = ["--steps", "2", "--weak-steps", "1", "--batch", "2", "--eval", "1"]
    for run in ("a", "b"):
        assert main([*args, "--out", str(tmp_path / run), "--weak-out",
                     str(tmp_path / f"{run}-weak")]) == 0
    for name in ("a", "a-weak"):
        w1 = load_file(tmp_path / name / "model.safetensors")
        w2 = load_file(tmp_path / name.replace("a", "b", 1) / "model.safetensors")
        assert w1.keys() == w2.keys() and all((w1[k] == w2[k]).all() for k in w1)
    assert GateConfig.load(tmp_path / "a" / "gate.json").answers == ANSWERS
    with Engine.from_pretrained(tmp_path / "a") as eng:
        sid = _session(eng, "ACME", RISING[:2])
        res = eng.query(sid, "Which way is ACME moving?",
                        Request(SamplingParams(max_tokens=1), fast_path="off")).result()
        assert res.tokens and len(res.tokens) == 1
