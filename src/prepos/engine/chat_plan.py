"""A conversation sent whole to an agentic session, as a stock client resends its history each
turn: matched against the session's (`prepos.chat.conversation.resume`), only what the session
lacks is committed, then the answer.

Two steps, so a caller can act between them (the server decides there whether the request
needs the model at all, and so whether backpressure applies):
- `plan`, before anything changes: where the conversation meets the session. One that
  does not extend the current version is refused (409 `conversation_diverged`), or, asked
  to, rolled back to the newest kept version it extends; the delta's order is checked (a tool
  result answers a call, the conversation ends with a user or tool message).
- `carry_out`: a rollback or a delta of several messages is checked to fit whole first, so a
  refusal changes nothing; then the rollback, the delta's messages but the last committed,
  and the turn on the last (a user message, a tool result, or none: the turn after what is
  committed, the exact entry the session pre-positioned).
"""

from __future__ import annotations

from dataclasses import dataclass

from prepos.chat.conversation import ConversationError, check_order, resume
from prepos.core import Request, SamplingParams
from prepos.decode.stream import Stream
from prepos.engine.session import check_context
from prepos.errors import InvalidInput, OverBudget


@dataclass(frozen=True)
class ChatPlan:
    """What a conversation asks of its session, worked out before anything changes."""

    sid: str
    rollback_to: int | None  # the kept version it extends, where not the current one
    held: tuple[dict, ...]  # what the session holds (at that version)
    delta: tuple[dict, ...]  # what it lacks, committed before the answer

    @property
    def commits_nothing(self) -> bool:
        """The conversation is the session's own, to the turn: its answer is the exact
        entry the session pre-positioned after its last commit."""
        return self.rollback_to is None and not self.delta


def plan(engine, sid: str, messages: list[dict], rollback: bool = False) -> ChatPlan:
    snap = engine.snapshot(sid)
    r = resume(sid, snap.version, snap.messages, messages,
               (lambda: engine.versions(sid)) if rollback else None)
    check_order(r.sent, r.delta, len(r.held))
    return ChatPlan(sid, r.rollback_to, tuple(r.held), tuple(r.delta))


def carry_out(engine, p: ChatPlan, req: Request) -> Stream:
    s = engine.session(p.sid)
    if p.rollback_to is not None or len(p.delta) > 1:
        check_fits(engine, s, [*p.held, *p.delta], req.sampling)
    if p.rollback_to is not None:
        engine.rollback(s.id, p.rollback_to, wait=False, origin=req.origin)
    last = p.delta[-1] if p.delta else None
    if last is not None and last["role"] not in ("user", "tool"):
        last = None  # a system message alone: committed, then the turn
    for m in p.delta[:-1] if last is not None else p.delta:
        engine.add_message(s.id, m["role"], m["content"], m.get("tool_calls"), wait=False,
                           origin=req.origin)
    if last is None:
        return engine.turn(s.id, None, req)
    if last["role"] == "tool":
        return engine.tool_result(s.id, last["content"], req)
    return engine.turn(s.id, last["content"], req)


def check_fits(engine, s, messages: list[dict],
               sampling: SamplingParams) -> None:
    """A multi-message delta is committed message by message: the whole conversation, with
    its answer, must fit the session before the first is."""
    try:
        text = engine.fmt.render(messages, s.spec.tools, generation_prompt=True)
    except InvalidInput as exc:
        raise ConversationError(str(exc), "messages", "invalid_input") from None
    n = len(engine.fmt.encode(text))
    answer = 1 if sampling.fit_context else sampling.max_tokens
    try:
        check_context(n, max(answer, engine.config.reserve_tokens), engine.max_context,
                      s.budget(engine.config.budget.session_cells), "the conversation",
                      "its answer (or the reserve)")
    except OverBudget as exc:
        raise ConversationError(str(exc), "messages", "context_length_exceeded") from None
