"""`Engine`'s request part: the answers (Algorithm 2; each returns the answer's `Stream` at
once) and a conversation sent whole, to a named session (`plan_chat`, `chat`) or kept for a
stock client (`converse`).

A mixin of `Engine` (`facade.py`), whose `__init__` sets what it uses."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Sequence

from prepos.core import Request, Result, SamplingParams
from prepos.decode.stream import Stream
from prepos.engine import chat_plan
from prepos.engine.admission import check_request, one_turn, prompt_ids
from prepos.engine.chat_plan import ChatPlan
from prepos.engine.logits import answers_from, keeps_top
from prepos.engine.session import HEADER, TURN, Session, query_key
from prepos.engine.session_spec import AGENTIC, STREAMING, SessionSpec
from prepos.engine.view import DEFAULT
from prepos.errors import Conflict, InvalidInput, PreposError


def arriving(entry):
    """An entry that submits a request's task, counted as arriving until it returns: a step
    from idle waits for it (`Scheduler.arrival`), so requests sent together start
    together."""
    @functools.wraps(entry)
    def counted(self, *args, **kwargs):
        arrived = self.scheduler.arrival()
        try:
            return entry(self, *args, **kwargs)
        finally:
            arrived()
    return counted


class Requests:
    # == requests (Algorithm 2) ============================================================
    # Each returns the answer's Stream at once (iterate it, or `.result()` for the Result).
    def _checked(self, req: Request) -> SamplingParams:  # before any state changes
        return check_request(req, self.backend, self.config.topk_sampling, self.answers.grammars)

    def query(self, sid: str, question: str, req: Request = DEFAULT) -> Stream:
        """Streaming: answer an ad-hoc or standing query. Never blocks on model work."""
        t0 = time.perf_counter()
        sampling = self._checked(req)
        s = self.sessions.get(sid)
        s.require(STREAMING)
        if not isinstance(question, str) or not question.strip():
            raise InvalidInput("question must be a non-empty string")
        self.fmt.check_text(question, "question")
        mode = req.fast_path or s.spec.fast_path
        snap, ready = s.current()
        header = ready.records.get(HEADER)
        evidence = None  # a withheld relaxed answer's full answer, as verified evidence
        if mode != "off":
            key = query_key(question)
            rec = ready.records.get(key)
            if rec is not None:  # realized entry == pre-positioned entry: zero added risk
                if answers_from(rec, sampling, self.backend.full_distribution):
                    return self.answers.exact(s, snap, ready, key, rec, sampling,
                                              req.logprobs, t0)
            elif mode == "relaxed" and header is not None and not sampling.shaped:
                kept = keeps_top(header, sampling.top_logprobs, self.backend.full_distribution)
                if kept and self.gate.fires(header):  # Eq. 12, then the class's verified risk
                    d = self.relaxed.decide(s, question, header)
                    if d.serve:  # one cached token, no scheduler; verified at idle
                        stream = self.answers.relaxed(ready, header, sampling, req.logprobs,
                                                      t0, d.answer_id)
                        self.relaxed.served(s, snap, question, header, d)
                        self.prepositioner.asked(s)
                        return stream
                    evidence = self.relaxed.withheld(s, snap, question, header, d,
                                                     sampling.greedy)
                else:
                    self.answers.count("gate_miss")
        self.prepositioner.asked(s)  # an exact answer counted its entry's request (and this)
        ent = s.entries(snap)
        entry = self.fmt.encode(self.fmt.frame(ent.user, question))
        return self.answers.prefill(s, snap.tokens + tuple(entry), len(snap.tokens),
                                    snap.version, ready, sampling, req.logprobs, t0,
                                    gap=header.gap if header is not None else None,
                                    on_finish=evidence)

    @arriving
    def turn(self, sid: str, user: str | None = None, req: Request = DEFAULT) -> Stream:
        """Agentic: commit `user` (if given), generate the assistant turn, commit it. A turn
        that ends in a tool call leaves the session awaiting a tool result. With
        `req.expected_version`, refuse (Conflict) if the session is at another version."""
        return self._agentic(sid, {"role": "user", "content": user} if user is not None else None,
                             req)

    @arriving
    def tool_result(self, sid: str, content: str, req: Request = DEFAULT) -> Stream:
        """Agentic: commit a tool result, resume delta-only from the pre-positioned envelope."""
        return self._agentic(sid, {"role": "tool", "content": content}, req)

    @one_turn  # called with the session's id: SessionBusy while another turn runs
    def _agentic(self, s: Session, message: dict | None, req: Request) -> Stream:
        t0 = time.perf_counter()
        sampling = self._checked(req)
        s.require(AGENTIC)
        mode = req.fast_path or s.spec.fast_path
        self.prepositioner.asked(s)
        base, ready = s.current()
        if req.expected_version is not None and base.version != req.expected_version:
            raise Conflict(f"session {s.id} is at version {base.version}, not "
                           f"{req.expected_version}")
        if message is None:
            if s.awaiting_tool:
                raise InvalidInput(f"session {s.id} awaits a tool result, not a new turn")
            turn = ready.records.get(TURN)
            if mode != "off" and turn is not None and answers_from(
                    turn, sampling, self.backend.full_distribution):
                return self.answers.exact(s, base, ready, TURN, turn, sampling, req.logprobs,
                                          t0, on_finish=self._commit_answer(s, base.version,
                                                                            req.origin))
            snap, dropped = base, None
        else:
            self.fmt.check_text(message["content"], "user" if message["role"] == "user"
                                else "content")
            n_header = len(s.entries(base).header)
            after_answer = bool(base.messages) and base.messages[-1]["role"] == "assistant"
            was_ready = ready.prepared  # as the request arrived
            snap, dropped = s.add_message(  # the request's delta, committed if it fits
                message, expected_version=req.expected_version, origin=req.origin,
                check=lambda n: self.room.check(s, n + n_header, sampling), turn=True)
            if after_answer:
                self.prepositioner.arrived(was_ready)
            self._emit("commit", s, snap)
        header = s.entries(snap).header
        return self.answers.prefill(s, snap.tokens + header, len(base.tokens), snap.version,
                                    dropped if dropped is not None else ready, sampling,
                                    req.logprobs, t0,
                                    on_finish=self._commit_answer(s, snap.version, req.origin),
                                    settle_dropped=dropped is not None)

    def _commit_answer(self, s: Session, version: int, origin: object
                       ) -> Callable[[Result], None]:
        def commit(res: Result) -> None:
            if res.finish_reason == "cancelled":  # the client left: the turn never happened
                return
            content, calls = self.fmt.parse_tool_calls(res.text)
            res.tool_calls = calls
            msg: dict = {"role": "assistant", "content": content}
            if calls:
                msg["tool_calls"] = calls
            snap, dropped = s.add_message(msg, expected_version=version, turn=True,
                                          origin=origin)
            self._committed(s, snap, dropped, wait=False)

        return commit

    @arriving
    def complete(self, sid: str, prompt: str | Sequence[int], req: Request = DEFAULT) -> Stream:
        """Raw completion: continue `prompt` exactly as given (text, tokenized with no chat
        template, or token ids taken as they are) on the session's KV, without touching its
        conversation. The stateless /v1/completions."""
        t0 = time.perf_counter()
        sampling = self._checked(req)
        s = self.sessions.get(sid)
        snap, ready = s.current()
        seq = prompt_ids(prompt, self.fmt, self.backend.vocab_size)
        return self.answers.prefill(s, seq, len(snap.tokens), snap.version, ready, sampling,
                                    req.logprobs, t0, prompt_logprobs=req.prompt_logprobs)

    def arrival(self) -> Callable[[], None]:
        """A caller's request on its way into an entry (a server's, from its bytes until the
        entry returns): a step from idle waits for it, at most `batch_wait_ms`, so requests
        sent together start together. Returns what says it has arrived (idempotent)."""
        return self.scheduler.arrival()

    # == a conversation sent whole (engine/chat_plan.py) ================================
    def plan_chat(self, sid: str, messages: list[dict], rollback: bool = False) -> ChatPlan:
        """Where a whole conversation meets agentic session `sid`, before anything changes:
        ConversationError where it diverges (unless `rollback`) or is out of order."""
        return chat_plan.plan(self, sid, messages, rollback)

    @arriving
    def chat(self, plan: ChatPlan, req: Request = DEFAULT) -> Stream:
        """Commit what `plan` says the session lacks, then answer (a turn or a tool result)."""
        return chat_plan.carry_out(self, plan, req)

    @arriving
    def converse(self, owner: str | None, messages: list[dict], tools: Sequence[dict] = (),
                 req: Request = DEFAULT) -> Stream:
        """A stock client's conversation, sent whole with no session named: continued on the
        kept session of this key and tools it extends (held by it until its answer ends,
        then indexed under what it committed), or on a new one kept for its next turn."""
        kept = self.conversations
        sid = kept.find(self, owner, tools, messages)
        if sid is None:
            system = messages[0]["content"] if messages[0]["role"] == "system" else None
            sid = kept.start(SessionSpec(AGENTIC, system, tuple(tools), (), "exact", True,
                                         None, owner=owner, implicit=True))
        try:
            stream = chat_plan.carry_out(self, chat_plan.plan(self, sid, messages), req)
        except BaseException:
            kept.release(sid)
            raise
        stream.on_end(lambda: kept.release(sid))
        return stream

    def evict_conversation(self) -> bool:
        """Close a session kept on a client's behalf to make room: the least recently used
        free kept conversation, else Responses chain; False if none is free."""
        return self.conversations.evict_one() or self.chains.evict_one()

    # == Responses chains: persistent sessions kept on a client's behalf ====================
    def find_chain(self, owner: str | None, tools: Sequence[dict],
                   messages: list[dict]) -> str | None:
        """The kept chain session of this key and tools `messages` extends by the most,
        held by the caller until `release_chain`; None if none is free."""
        return self.chains.find(self, owner, tools, messages)

    def keep_chain(self, sid: str, owner: str | None) -> None:
        """Keep a new chain session (held by its maker until `release_chain`)."""
        self.chains.keep(sid, owner)

    def release_chain(self, sid: str) -> None:
        """Its request is done: indexed under its conversation as committed now."""
        self.chains.release(sid)

    def evict_chain(self, owner: str | None | object = ...) -> bool:
        """Close the least recently used free Responses chain (`owner`'s, where one is
        given): they are persistent sessions, so they give way at a session limit; False if
        none is free."""
        return self.chains.evict_one(owner)

    def publish_conversations(self, publish: Callable[[str, bytes | None], None]) -> None:
        """`publish(sid, hash)` at every change of what a kept conversation is indexed under
        (None once it is gone): the cluster's directory."""
        self.conversations.publish = publish

    def _close_kept(self, sid: str) -> None:
        with contextlib.suppress(PreposError):
            self.close_session(sid)
