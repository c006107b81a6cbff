"""Which engine calls answer an OpenAI request, once its input is checked.

Chat: stateless (an ephemeral agentic session with the request's tools, closed after the
answer), a streaming session's query (one user message), or an agentic session's turn:
the conversation is matched against the session's (`prepos.conversation`), only the delta
is committed, and an empty delta after a committed user or tool message is the exact fast
path. Completions: a streaming session's query, or a raw completion on an ephemeral session.
"""

from __future__ import annotations

from starlette.responses import Response

from prepos.conversation import check_order, resume
from prepos.errors import InvalidInput
from prepos.server.errors import ApiError
from prepos.server.openai_format import ChatReply, CompletionReply, respond
from prepos.server.schemas import ChatCompletion, Completion
from prepos.server.state import ServerState
from prepos.session import AGENTIC, STREAMING, TURN, SessionSpec, query_key


class ChatCall:
    def __init__(self, state: ServerState, body: ChatCompletion, sampling, receive):
        self.state = state
        self.receive = receive  # the request's: a client that leaves cancels its stream
        self.body = body
        self.sampling = sampling
        self.logprobs = bool(body.logprobs)

    async def _respond(self, stream, sid: str | None, agentic: bool, tools: bool,
                       cleanup=None) -> Response:
        reply = ChatReply(self.state, self.body, sid, agentic, tools)
        return await respond(reply, self.state, self.receive, stream, cleanup)

    async def stateless(self, eng, owner, msgs: list[dict], tools: list[dict]) -> Response:
        system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
        rest = msgs[1:] if system is not None else msgs
        check_order([], rest, 1 if system is not None else 0)
        self.state.backpressure(eng)
        spec = SessionSpec(AGENTIC, system, tuple(tools), (), "off", False, None, owner=owner)

        sid, stream = await self.state.run(self.state.start_ephemeral, eng, spec, lambda sid:
                                           eng.turn_stream(sid, None, self.sampling, "off",
                                                           self.logprobs, owner), [(0, msgs)])
        return await self._respond(stream, None, agentic=True, tools=bool(tools),
                                   cleanup=lambda: self.state.close_after(stream, sid))

    async def streaming(self, eng, owner, s, msgs: list[dict]) -> Response:
        """A streaming session's query, asked as one user message."""
        asked = [m for m in msgs if m["role"] != "system"]
        if len(asked) != 1 or asked[0]["role"] != "user":
            raise ApiError(400, "invalid_request", f"session {s.id} is a streaming session: a "
                           "chat request asks one user message (the query); data is appended "
                           f"with POST /sessions/{s.id}/append", "messages")
        if msgs[0]["role"] == "system" and msgs[0]["content"] != (s.spec.system or ""):
            raise ApiError(409, "conversation_diverged", f"the system message differs from "
                           f"session {s.id}'s", "messages[0]")
        question = asked[0]["content"]
        mode = self.body.fast_path
        stream = self.state.start_exact(
            eng, s.id, query_key(question), mode, self.sampling,
            lambda: eng.query_stream(s.id, question, self.sampling, mode, self.logprobs, owner))
        return await self._respond(stream, s.id, agentic=False, tools=False)

    async def agentic(self, eng, owner, s, msgs: list[dict]) -> Response:
        """Delta-only: commit what the session lacks, then answer."""
        snap = eng.snapshot(s.id)
        rollback = self.body.on_divergence == "rollback"
        r = resume(s.id, snap.version, snap.messages, msgs,
                   (lambda: eng.versions(s.id)) if rollback else None)
        target, held, delta = r.rollback_to, r.held, r.delta
        check_order(held, delta, len(held))
        mode = self.body.fast_path
        tools = bool(s.spec.tools)
        if target is None and not delta:
            if self.state.will_be_fast(eng, s.id, TURN, mode, self.sampling):
                stream = eng.turn_stream(s.id, None, self.sampling, mode, self.logprobs, owner)
                return await self._respond(stream, s.id, agentic=True, tools=tools)
            if self.body.stream and eng.serves_exact(s.id, TURN, mode):
                # a streamed exact turn that decodes on: its first token is out at once
                stream = eng.turn_stream(s.id, None, self.sampling, mode, self.logprobs, owner)
                return await self._respond(stream, s.id, agentic=True, tools=tools)
        self.state.backpressure(eng)
        if target is not None or len(delta) > 1:
            self._check_fits(eng, s, held + delta)

        def start():
            if target is not None:
                eng.rollback(s.id, target, wait=False, owner=owner)
            for m in delta[:-1]:
                eng.add_message(s.id, m["role"], m["content"], m.get("tool_calls"),
                                wait=False, owner=owner)
            last = delta[-1] if delta else None
            if last is None:
                return eng.turn_stream(s.id, None, self.sampling, mode, self.logprobs, owner)
            if last["role"] == "tool":
                return eng.tool_result_stream(s.id, last["content"], self.sampling, mode,
                                              self.logprobs, owner)
            return eng.turn_stream(s.id, last["content"], self.sampling, mode, self.logprobs,
                                   owner)

        stream = await self.state.run(start)
        return await self._respond(stream, s.id, agentic=True, tools=tools)

    def _check_fits(self, eng, s, msgs: list[dict]) -> None:
        """A multi-message delta is committed message by message: check the whole of it
        fits before the first, so a refusal leaves the session unchanged."""
        try:
            text = eng.fmt.render(msgs, s.spec.tools, generation_prompt=True)
        except InvalidInput as exc:
            raise ApiError(400, "invalid_input", str(exc), "messages") from None
        n = len(eng.fmt.encode(text))
        room = min(eng.max_context, s.budget(eng.config.budget.session_cells))
        need = n + max(self.sampling.max_tokens, eng.config.reserve_tokens)
        if need > room:
            raise ApiError(413, "over_budget", f"the conversation is {n} tokens; with "
                           f"max_tokens {self.sampling.max_tokens} it needs {need} of the "
                           f"{room} this session can hold", "messages")


async def complete(state: ServerState, receive, eng, owner, body: Completion, prompt: str,
                   sampling) -> Response:
    want_lp = body.logprobs is not None
    if body.session_id is not None:
        s = state.session(eng, body.session_id, owner, "session_id")
        if s.kind != STREAMING:
            raise ApiError(409, "wrong_session_kind", f"session {s.id} is agentic: drive it "
                           "with /v1/chat/completions", "session_id")
        stream = state.start_exact(
            eng, s.id, query_key(prompt), body.fast_path, sampling,
            lambda: eng.query_stream(s.id, prompt, sampling, body.fast_path, want_lp, owner))
        return await respond(CompletionReply(state, body, s.id), state, receive, stream)
    state.backpressure(eng)
    # stateless: the prompt is continued as given, no chat template (a raw completion)
    spec = SessionSpec(STREAMING, None, (), (), "off", False, None, owner=owner)
    sid, stream = await state.run(state.start_ephemeral, eng, spec, lambda sid:
                                  eng.complete_stream(sid, prompt, sampling, want_lp, owner))
    return await respond(CompletionReply(state, body, None), state, receive, stream,
                         cleanup=lambda: state.close_after(stream, sid))
