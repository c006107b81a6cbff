"""Invariants under random interleavings of updates, rollbacks, shifts, tool calls,
pre-positions and pre-decodes (racing with mutations: chunks of 2 tokens, idle work not
awaited) and queries.

(a) an exact-match fast-path answer under greedy decoding equals a cold forward, token for
    token, whether served from a pre-decoded answer, decoded live, or both; so does every
    pre-decoded answer as stored;
(b) no answer is served from a ready record (or a pre-decoded answer) whose version differs
    from the session's; a mutation leaves nothing of the old version's to serve;
(c) budget skips never evict committed state, and a pre-decode stays within the budget;
(d) idle work may copy committed KV down, never moves a KV down: after idle time every KV
    resident before is resident still, holding the same tokens, and every idle KV's
    committed tokens are in a clean copy, so a request moves it down saving nothing;
across KVs moved down to the RAM tier (saved, or to the clean copy kept since they came
back) and brought back at any point between the others, and new sessions starting from the
prefix another session holds, resident or in the RAM tier.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prepos.config import BudgetConfig, EngineConfig, GateConfig
from prepos.core import AnswerPath, Match, Request, SamplingParams
from prepos.engine import Engine
from tests.support.helpers import cold_logits, greedy_agrees, promote, tolerance
from tests.support.models import BACKENDS, backend_config

Q = "What is the trend?"
WORDS = st.sampled_from(["AAPL 101.5", "MSFT 99", "up 3", "down 1.25", "flat", "NVDA 7 8 9"])
CALL = {"type": "function", "function": {"name": "get_price", "arguments": {"t": "AAPL"}}}
TOOLS = [{"type": "function", "function": {"name": "get_price", "parameters": {}}}]


@pytest.fixture(scope="module", params=BACKENDS)
def engine(model_dirs, request):
    """Each in-process back end, llama.cpp in both cache layouts (a stream holds 1024 cells:
    as much as max_context)."""
    eng = Engine.from_pretrained(model_dirs["chatml"], EngineConfig(
        threads=2, chunk_tokens=2, max_context=1024, reserve_tokens=48, predecode_tokens=6,
        predecode_min_hit=0.0,
        budget=BudgetConfig(session_cells=4096, engine_cells=1 << 20),
        **backend_config(request.param)))
    vocab = eng.fmt.tokenizer.batch_decode([[i] for i in range(len(eng.fmt.tokenizer))])
    eng.set_gate(GateConfig(tau=-1.0, answers=tuple({t.strip() for t in vocab if t.strip()})))
    eng.pool.copy_beyond = 0  # idle housekeeping copies every idle KV down
    yield eng
    eng.close()


def run_machine(engine):
    class Interleavings(RuleBasedStateMachine):
        @initialize()
        def start(self):
            self.eng = engine
            self.stream = engine.create_session("streaming", system="Market.", standing=[Q],
                                                fast_path="relaxed")
            self.agent = engine.create_session("agentic", system="Tools.", tools=TOOLS)
            self.tight = engine.create_session("streaming", system="Market.", standing=[Q],
                                               budget_cells=40)
            self.tight_fill = 0

        def teardown(self):
            for sid in (self.stream, self.agent, self.tight):
                self.eng.close_session(sid)

        # -- mutations ---------------------------------------------------------------
        @rule(text=WORDS, wait=st.booleans())
        def append(self, text, wait):
            ready = self.eng.session(self.stream).current()[1]
            self.eng.append(self.stream, text, wait=wait)
            assert ready.answer(("query", Q)) is None  # (b): gone with its version

        @rule(text=WORDS)
        def append_tight(self, text):
            s = self.eng.session(self.tight)
            if len(s.snap.tokens) + 20 < 40 - 0:
                self.eng.append(self.tight, text, wait=True)

        @rule(data=st.data())
        def rollback(self, data):
            s = self.eng.session(self.stream)
            version = data.draw(st.sampled_from(sorted(s.history)))
            self.eng.rollback(self.stream, version, wait=data.draw(st.booleans()))

        @precondition(lambda self: len(self.eng.session(self.stream).snap.messages) >= 3)
        @rule()
        def shift(self):
            self.eng.shift(self.stream, drop=1, wait=False)

        @rule()
        def idle(self):
            self.eng.wait_idle()

        # -- agentic -------------------------------------------------------------------
        @precondition(lambda self: not self.eng.session(self.agent).awaiting_tool
                      and len(self.eng.session(self.agent).snap.tokens) < 600)
        @rule(text=WORDS)
        def tool_call(self, text):
            self.eng.add_message(self.agent, "user", text, wait=False)
            self.eng.add_message(self.agent, "assistant", "", tool_calls=[CALL], wait=False)

        @precondition(lambda self: self.eng.session(self.agent).awaiting_tool)
        @rule(text=WORDS, generate=st.booleans())
        def tool_result(self, text, generate):
            s = self.eng.session(self.agent)
            if not generate:
                self.eng.add_message(self.agent, "tool", text, wait=False)
                return
            env = s.entries().tool
            seq = s.snap.tokens + tuple(self.eng.fmt.encode(self.eng.fmt.frame(env, text)))
            res = self.eng.tool_result(self.agent, text,
                                       Request(SamplingParams(max_tokens=1))).result()
            assert res.path in (AnswerPath.FALL, AnswerPath.COLD)
            assert greedy_agrees(self.eng, seq, res.tokens[0]) if res.tokens else True

        @precondition(lambda self: self.eng.session(self.agent).snap.messages[-1]["role"]
                      == "tool")
        @rule(n=st.integers(1, 8))
        def next_turn(self, n):
            s = self.eng.session(self.agent)
            seq = list(s.snap.tokens + s.entries().header)
            version = s.version
            res = self.eng.turn(self.agent, None, Request(SamplingParams(max_tokens=n))).result()
            if res.path is AnswerPath.FAST:
                assert res.match is Match.EXACT and res.version == version  # (b)
            else:
                assert res.predecoded == 0
            for tok in res.tokens:  # (a), pre-decoded and live tokens alike
                assert greedy_agrees(self.eng, seq, tok)
                seq.append(tok)

        # -- queries -------------------------------------------------------------------
        @rule(n=st.integers(1, 9))
        def standing_query(self, n):
            s = self.eng.session(self.stream)
            version, committed = s.version, s.snap.tokens
            entry = tuple(self.eng.fmt.encode(self.eng.fmt.frame(s.entries().user, Q)))
            res = self.eng.query(self.stream, Q,
                                 Request(SamplingParams(max_tokens=n), fast_path="exact")).result()
            assert res.version == version  # (b)
            seq = list(committed + entry)
            assert res.predecoded <= len(res.tokens)
            for tok in res.tokens:  # (a), the first token and every one decoded after it
                assert greedy_agrees(self.eng, seq, tok)
                seq.append(tok)

        @rule(which=st.sampled_from(["stream", "tight"]))
        def predecoded_answer(self, which):
            """A pre-decoded answer as stored, read while it may still be decoding, is the
            greedy answer of its version's committed tokens and entry."""
            s = self.eng.session(getattr(self, which))
            snap, ready = s.current()
            rec, answer = ready.records.get(("query", Q)), ready.answer(("query", Q))
            if answer is None:
                return
            assert ready.version == snap.version and rec.version == snap.version  # (b)
            seq = list(snap.tokens + rec.entry)
            assert answer.tokens[0] == rec.argmax
            for tok in answer.tokens:  # (a)
                assert greedy_agrees(self.eng, seq, tok)
                seq.append(tok)

        @rule()
        def relaxed_query(self):
            s = self.eng.session(self.stream)
            version, committed = s.version, s.snap.tokens
            header = s.entries().header
            rec = self.eng.ready_header(self.stream)
            if rec is not None:  # the class's evidence says what the header does (a random
                promote(self.eng, "Is it rising?", rec.argmax)  # model's full path need not)
            res = self.eng.query(self.stream, "Is it rising?",
                                 Request(SamplingParams(max_tokens=1))).result()
            if res.match is Match.RELAXED:
                assert res.version == version  # (b): only a current record is served
                ref = cold_logits(self.eng, committed + header)
                assert float(ref.max() - ref[res.tokens[0]]) <= tolerance(self.eng)

        @rule()
        def adhoc_query_gate_off(self):
            s = self.eng.session(self.stream)
            version, committed = s.version, s.snap.tokens
            q = "Is it rising?"
            entry = tuple(self.eng.fmt.encode(self.eng.fmt.frame(s.entries().user, q)))
            res = self.eng.query(self.stream, q,
                                 Request(SamplingParams(max_tokens=1), fast_path="off")).result()
            assert res.path in (AnswerPath.FALL, AnswerPath.COLD) and res.version == version
            assert greedy_agrees(self.eng, committed + entry, res.tokens[0])

        @rule(which=st.sampled_from(["stream", "agent", "tight"]))
        def spill(self, which):
            """The session's KV moves down to the RAM tier, at any point (between the chunks
            of a pre-position too); its next forward brings it back."""
            sid, pool = getattr(self, which), self.eng.pool

            def move():
                kv = pool.find(sid)
                if kv is not None and kv.handle is not None:
                    pool._spill(kv)
                yield

            self.eng._call(move(), key=sid)

        @rule(which=st.sampled_from(["stream", "agent"]), away=st.booleans(),
              n=st.integers(1, 3))
        def newcomer(self, which, away, n):
            """A new session whose prompt begins with another session's committed tokens:
            it starts from the prefix that session's KV holds, resident or (`away`) moved
            down to the RAM tier, and answers as a cold forward."""
            donor = getattr(self, which)
            if away:
                self.spill(which)
            seq = list(self.eng.session(donor).snap.tokens) + self.eng.fmt.encode(Q)
            sid = self.eng.create_session("agentic", preposition=False)
            try:
                res = self.eng.complete(sid, seq, Request(SamplingParams(max_tokens=n))).result()
            finally:
                self.eng.close_session(sid)
            for tok in res.tokens:  # (a)
                assert greedy_agrees(self.eng, seq, tok)
                seq.append(tok)

        # -- (c) -----------------------------------------------------------------------
        @invariant()
        def committed_state_never_evicted(self):
            self.eng.wait_idle()
            for sid in (self.stream, self.tight):
                s = self.eng.session(sid)
                kv = self.eng.pool.get(sid).tokens
                assert kv[: len(s.snap.tokens)] == list(s.snap.tokens)
            t = self.eng.session(self.tight)
            for rec in t.ready.records.values():
                assert rec.p <= 40
            for key, answer in t.ready.answers.items():  # (c): its cells within the budget
                assert t.ready.records[key].p + len(answer.tokens) - 1 <= 40

        # -- (d) -----------------------------------------------------------------------
        @rule(which=st.sampled_from(["stream", "agent", "tight"]), move=st.booleans())
        def housekeeping(self, which, move):
            """Idle time (housekeeping run once more besides) moves no KV down and leaves
            each idle KV whole in a clean copy: moving one down (`move`) then saves
            nothing."""
            eng, pool = self.eng, self.eng.pool
            eng.wait_idle()
            before = {sid: list(kv.tokens) for sid, kv in pool._kv.items()
                      if kv.handle is not None}
            spills = pool.counts["spills"]
            eng.scheduler.submit(pool.housekeeping(), idle=True)
            eng.wait_idle()
            after = {sid: list(kv.tokens) for sid, kv in pool._kv.items()
                     if kv.handle is not None}
            assert after == before and pool.counts["spills"] == spills
            for sid, kv in pool._kv.items():
                if kv.handle is not None and kv.tokens:
                    assert len(kv.tokens) == kv.clean and sid in pool._saved
            if move:
                saves = pool.counts["saves"]
                self.spill(which)
                assert pool.counts["saves"] == saves  # moved down to its clean copy

    Interleavings.TestCase.settings = settings(
        max_examples=20, stateful_step_count=15, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    Interleavings.TestCase().runTest()


def test_interleavings_keep_the_invariants(engine):
    run_machine(engine)
    # the interleavings did reach every path and did race pre-positions with mutations
    paths = engine.paths
    assert paths["fast_exact"] > 0 and paths["fast_relaxed"] > 0 and paths["fall"] > 0
    counters = engine.prepositioner.counters
    # mutations raced pre-positions: caught in flight (discarded) or before they started
    assert counters.discarded + counters.superseded > 0
    assert counters.skipped > 0 and counters.invalidated > 0
    # answers were pre-decoded, served from, and dropped by mutations
    assert counters.predecoded_tokens > 0 and counters.predecode_served > 0
    assert counters.predecode_wasted > 0
    # KVs moved down and came back between the other steps
    assert engine.pool.counts["spills"] > 0 and engine.pool.counts["restores"] > 0
    # idle time copied KVs down, and KVs moved down to their clean copies
    assert engine.pool.counts["idle_saves"] > 0 and engine.pool.counts["clean_moves"] > 0
    # new sessions started from a prefix another held: loaded from the RAM tier, and, where
    # a request leaves idle KVs resident (forwards that scan their own cells), resident
    hits, loads = engine.pool.index.hits, engine.pool.counts["prefix_loads"]
    assert hits >= loads > 0
    assert hits > loads or engine.backend.scans_resident
