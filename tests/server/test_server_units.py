"""Server parts without a server: the journal's delta encoding, checkpoints and pruning
against a real engine; tool-call hold-back in streamed chat; limits."""

from __future__ import annotations

import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.chat.tool_formats import safe_prefix
from prepos.server.http.errors import ApiError
from prepos.server.http.limits import Limits
from prepos.server.http.metrics import TOKEN_STAGES
from prepos.server.store.journal import Journal, apply, diff

messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                           "content": st.sampled_from(list("abcde"))}),
                    max_size=8)


@given(messages, messages)
@settings(max_examples=300, deadline=None)
def test_diff_then_apply_gives_the_new_messages(base, new):
    ops = diff(base, new)
    assert apply(base, ops) == new
    assert sum(1 for op in ops if isinstance(op, dict)) <= len(new)


def test_appends_and_shifts_are_stored_as_slices():
    base = [{"role": "system", "content": "s"}] + [{"role": "user", "content": str(i)}
                                                  for i in range(5)]
    new = base + [{"role": "user", "content": "5"}]
    assert diff(base, new) == [[0, 6], {"m": {"role": "user", "content": "5"}}]
    shifted = [base[0], *base[3:]]
    assert diff(base, shifted) == [[0, 1], [3, 6]]


def _kept(session):
    return [(v, list(m)) for v, m in session.versions().items()]


def test_journal_restores_every_kept_version(make_engine, tmp_path):
    eng = make_engine("chatml", max_versions=8)
    path = tmp_path / "j.sqlite3"
    journal = Journal(path, max_versions=8, checkpoint_every=4)
    journal.attach(eng)
    s = eng.create_session("streaming", system="sys", standing=["Q?"])
    for i in range(20):
        eng.append(s, f"AAPL {100 + i}", wait=False)
    eng.rollback(s, 15, wait=False)
    eng.shift(s, drop=2, wait=False)
    a = eng.create_session("agentic", system="sys", owner="key-x")
    eng.add_message(a, "user", "hi", wait=False)
    eng.add_message(a, "assistant", "", tool_calls=[{"function": {"name": "f",
                                                                  "arguments": "{}"}}],
                    wait=False)
    gone = eng.create_session("streaming", system="sys")
    eng.append(gone, "x", wait=False)
    eng.close_session(gone)
    eng.wait_idle()
    journal.close()

    loaded = {sid: (spec, history) for sid, spec, history in Journal(path, 8, 4).load()}
    assert set(loaded) == {s, a}
    for sid in (s, a):
        spec, history = loaded[sid]
        assert spec == eng.session(sid).spec
        assert history == _kept(eng.session(sid))
    assert loaded[a][0].owner == "key-x"
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT COUNT(*) FROM versions WHERE sid=?", (s,)).fetchone()[0]
    assert rows <= 8 + 4  # pruned behind a checkpoint
    # a restored engine session equals the original, and can roll back to a kept version
    eng2 = make_engine("chatml", max_versions=8)
    spec, history = loaded[s]
    eng2.restore_session(s, spec, history)
    assert eng2.session(s).snap.tokens == eng.session(s).snap.tokens
    oldest = history[0][0]
    eng2.rollback(s, oldest, wait=False)
    assert eng2.session(s).snap.messages == tuple(history[0][1])


def test_tool_call_markup_is_held_back():
    assert safe_prefix("Let me check.") == len("Let me check.")
    assert safe_prefix("Let me check. <tool_call>{") == len("Let me check. ")
    assert safe_prefix("Let me check. <tool") == len("Let me check. ")
    assert safe_prefix(' {"name": "f"') == 0


def test_limits():
    lim = Limits(max_tokens=8, default_max_tokens=4, max_input_tokens=10)
    assert lim.sampling(None).max_tokens == 4
    with pytest.raises(ApiError) as err:  # the session API's: refused
        lim.sampling(9)
    assert err.value.code == "max_tokens_limit"
    cut = lim.sampling(9, fit=True)  # the OpenAI and Anthropic routes': cut, to the context too
    assert (cut.max_tokens, cut.fit_context) == (8, True)
    assert lim.sampling(None, fit=True).max_tokens == 8
    strict = Limits(max_tokens=8, strict_max_tokens=True)
    with pytest.raises(ApiError) as err:
        strict.sampling(9, fit=True)
    assert err.value.code == "max_tokens_limit"
    assert not strict.sampling(5, fit=True).fit_context  # asked within: refused past the context
    with pytest.raises(ApiError) as err:  # the engine's check, naming its field
        lim.sampling(2, temperature=-1)
    assert (err.value.code, err.value.param) == ("invalid_sampling", "temperature")
    with pytest.raises(ApiError) as err:
        lim.sampling(2, seed=2**64)
    assert (err.value.code, err.value.param) == ("invalid_sampling", "seed")

    class Fmt:
        @staticmethod
        def encode(text):
            return text.split()

    class Eng:
        fmt = Fmt()

    lim.check_input(Eng, "0123456789", "data")  # within the limit in bytes: not tokenized
    lim.check_input(Eng, "a " * 10, "data")  # 20 bytes, 10 tokens
    with pytest.raises(ApiError) as err:
        lim.check_input(Eng, "a " * 11, "data")
    assert err.value.status == 413 and "11 tokens" in err.value.message


def test_serve_options_reach_the_engine_config_and_bad_ones_exit_2(capsys):
    from prepos.server.http.app import main
    from prepos.server.http.options import config_from_args, parse_args

    cfg = config_from_args(parse_args(["--lookup-tokens", "0", "--relaxed-start", "serve",
                                       "--relaxed-r-max", "0.1", "--lookup-said-tokens", "64",
                                       "--journal", "none"]))
    assert (cfg.engine.lookup_tokens, cfg.engine.lookup_said_tokens) == (0, 64)
    assert (cfg.engine.kv_layout, cfg.engine.max_sequences) == ("unified", 256)
    assert cfg.engine.kv_idle_cells == 0
    for arg, idle in (("512", 512), ("-1", None)):
        idle_cfg = config_from_args(parse_args(["--kv-idle-cells", arg, "--journal", "none"]))
        assert idle_cfg.engine.kv_idle_cells == idle
    assert (cfg.engine.relaxed.start, cfg.engine.relaxed.r_max) == ("serve", 0.1)
    cfg = config_from_args(parse_args(["--kv-layout", "streams", "--kv-sequences", "16",
                                       "--kv-cells", "65536", "--journal", "none"]))
    assert (cfg.engine.kv_layout, cfg.engine.max_sequences, cfg.engine.kv_cells) == (
        "streams", 16, 65536)
    assert main(["--relaxed-r-max", "2", "--journal", "none"]) == 2
    assert "r_max" in capsys.readouterr().err
    assert main(["--lookup-tokens", "-1", "--journal", "none"]) == 2
    assert "--lookup-tokens" in capsys.readouterr().err
    assert main(["--lookup-said-tokens", "-1", "--journal", "none"]) == 2
    assert "--lookup-said-tokens" in capsys.readouterr().err


def test_default_threads_count_each_physical_core_once(monkeypatch):
    """Four CPUs, two cores of two hyperthreads each: two threads; without topology files
    each CPU counts; `prepos serve` defaults to it."""
    from pathlib import Path

    from prepos import config
    from prepos.server.http.options import parse_args

    siblings = {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})

    def read_text(self):
        return siblings[int(self.parent.parent.name.removeprefix("cpu"))] + "\n"

    monkeypatch.setattr(Path, "read_text", read_text)
    assert config.default_threads() == 2
    monkeypatch.setattr(Path, "read_text", lambda self: (_ for _ in ()).throw(OSError()))
    assert config.default_threads() == 4
    monkeypatch.undo()
    assert parse_args([]).threads == config.default_threads() >= 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(TOKEN_STAGES),
                          st.one_of(st.sampled_from([5e-6, 1e-3, 0.01, 0.25]),
                                    st.floats(0, 1, allow_nan=False))), max_size=40))
def test_our_histograms_write_what_prometheus_clients_own_would(observed):
    """`Buckets` (a bisect per observation, its lines written by itself) writes the text a
    prometheus_client Histogram with the same bounds writes, less its `_created` series (a
    value on a bound counts in it), every label value exported from 0."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from prepos.server.http.metrics import STAGE_BUCKETS, Buckets

    ours = Buckets("prepos:token_stage_seconds", "A stage's \\ time\nper token", "stage",
                   TOKEN_STAGES, STAGE_BUCKETS)
    registry = CollectorRegistry()
    theirs = Histogram("prepos:token_stage_seconds", "A stage's \\ time\nper token", ["stage"],
                       buckets=STAGE_BUCKETS, registry=registry)
    for stage in TOKEN_STAGES:
        theirs.labels(stage)
    for stage, v in observed:
        ours.observer(stage)(v)
        theirs.labels(stage).observe(v)
    assert ours.text().splitlines() == _without_created(generate_latest(registry).decode())


@given(st.integers(0, 10**15))
def test_a_count_is_written_as_prometheus_client_writes_its_float(n):
    from prometheus_client.utils import floatToGoString

    from prepos.server.http.exposition import count_text

    assert count_text(n) == floatToGoString(float(n))


def _without_created(text: str) -> list[str]:
    """generate_latest's lines less the `_created` series (their HELP, TYPE and samples)."""
    out, skip = [], False
    for line in text.splitlines():
        if line.startswith("# HELP "):
            skip = line.split()[2].endswith("_created")
        if not skip:
            out.append(line)
    return out


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=12),
                          st.one_of(st.floats(allow_nan=True), st.integers(0, 10**12))),
                max_size=12),
       st.lists(st.floats(0, 100, allow_nan=False), max_size=20))
def test_the_exposition_writes_what_generate_latest_writes(labelled, observed):
    """The scrape's text is prometheus_client's own, less the `_created` series, for any
    label values (quotes, backslashes, newlines, any Unicode) and any values (NaN, ±Inf,
    large, negative), scrape after scrape (its kept names reused), counters, gauges and
    histograms alike."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from prepos.server.http.exposition import Exposition

    r = CollectorRegistry()
    counter = Counter("prepos:things", "Things\nby kind \\ all", ["kind"], registry=r)
    gauge = Gauge("prepos:level", "A level", ["kind", "where"], registry=r)
    hist = Histogram("prepos:seconds", "Seconds", ["path"], buckets=(0.5, 1.0, 50.0),
                     registry=r)
    Gauge("prepos:plain", "No labels", registry=r).set(3)
    exposition = Exposition(r)
    for _ in range(2):
        for label, value in labelled:
            if value == value and value >= 0:
                counter.labels(label).inc(value)
            gauge.labels(label, "x").set(value)
        for v in observed:
            hist.labels("p").observe(v)
        assert exposition.render().decode().splitlines() == \
            _without_created(generate_latest(r).decode())


@pytest.fixture(scope="module")
def engine_metrics_dict(model_dirs):
    """A real engine's `metrics()`, after a session has been pre-positioned."""
    from prepos.config import EngineConfig, GateConfig
    from prepos.engine import Engine

    eng = Engine.from_pretrained(model_dirs["chatml"], EngineConfig(
        backend="torch", threads=2, gate=GateConfig(tau=0.0, answers=())))
    try:
        eng.create_session("streaming", standing=("up?",))
        eng.wait_idle()
        yield eng.metrics()
    finally:
        eng.close()


@settings(max_examples=60, deadline=None)
@given(st.data(), st.text(max_size=12))
def test_the_engine_families_write_what_prometheus_client_writes(engine_metrics_dict, data,
                                                                  model):
    """The engine's families, written as text at scrape time (`engine_metrics`), are the
    text prometheus_client writes for the same families and values: for any numbers in the
    engine's metrics (NaN, ±Inf, large, negative) and any model name, scrape after scrape
    (each family's formatted names reused)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from prepos.server.http import engine_metrics

    ints = st.integers(-10**18, 10**18)
    floats = st.floats(allow_nan=True, allow_infinity=True)

    def drawn(v):
        if isinstance(v, dict):
            return {k: drawn(x) for k, x in v.items()}
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return v
        return data.draw(ints if isinstance(v, int) else floats)

    for _ in range(2):
        m = drawn(engine_metrics_dict)
        pairs = [(f, v if f.label is None else list(v))
                 for f, v in engine_metrics.samples(m, model)]

        class Families:
            def collect(self):
                for f, v in pairs:
                    kind = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
                    if f.label is None:
                        yield kind(f.name, f.doc, v)
                        continue
                    fam = kind(f.name, f.doc, labels=[f.label])
                    for label, x in v:
                        fam.add_metric([label], x)
                    yield fam

        registry = CollectorRegistry()
        registry.register(Families())
        assert engine_metrics.text(m, model) == generate_latest(registry).decode()


def test_every_family_the_server_exports_is_a_type_the_exposition_writes():
    from prepos.server.http.exposition import _TYPES
    from prepos.server.http.metrics import Metrics

    m = Metrics("m")
    assert {f.type for f in m.registry.collect()} <= set(_TYPES)
    assert m.render().startswith(b"# HELP prepos:")


def test_every_error_class_has_an_http_status_named_in_the_http_layer():
    """The engine's, back ends' and store's errors carry no HTTP; each one's code is mapped
    to a status in `server/http/errors.py`, so a new error class gets one deliberately."""
    import importlib

    from prepos.errors import PreposError
    from prepos.server.http.errors import STATUS, as_api_error

    for mod in ("prepos.chat.conversation", "prepos.backends.remote_protocol",
                "prepos.backends.llama_cpp", "prepos.server.store.idempotency",
                "prepos.server.store.database", "prepos.server.store.lease",
                "prepos.server.store.conversations"):
        importlib.import_module(mod)
    seen, todo = [], [PreposError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    assert len(seen) > 20
    for cls in seen:
        assert not hasattr(cls, "status"), f"{cls.__name__} carries an HTTP status"
        if cls.__name__ != "ConversationError":  # its code is given per refusal
            assert cls.code in STATUS, f"{cls.__name__}'s code {cls.code!r} has no status"
    from prepos.backends.remote_protocol import AnswerInterrupted
    from prepos.errors import SessionNotFound, TooManySessions

    assert [as_api_error(e()).status for e in (SessionNotFound, TooManySessions,
                                               AnswerInterrupted)] == [404, 429, 503]
