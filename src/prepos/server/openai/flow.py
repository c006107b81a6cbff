"""Which engine calls answer an OpenAI request, once its input is checked.

Chat: stateless (one choice on the implicit session the conversation extends, or a new one
kept for its next turn, `engine/implicit.py`, a constrained forced call included; several
choices, a continued assistant message, or a forced call a back end cannot constrain, on
ephemeral sessions closed after the answer), a streaming session's
query (one user message), or an agentic session's turn:
the conversation is matched against the session's (`prepos.chat.conversation`), only the delta
is committed, and an empty delta after a committed user or tool message is the exact fast
path. Completions: a streaming session's query, or a raw completion on an ephemeral session.

A stateless conversation that ends with an assistant message is continued (the message's
text is the start of the answer, which returns what follows it). `tool_choice` "required"
or a named function is one call, constrained by a grammar of the template's call markup
around arguments valid for the function's parameter schema (of any tool, for "required"),
the answer ending where the call closes; on a back end that samples itself (no grammars)
it is an unconstrained continuation of the calls' opening. `n` choices are n requests: on
a streaming session each is answered from the same ready distribution when one is cached
(n answers, one cache); an agentic session commits one answer per turn, so it takes n = 1
only.
"""

from __future__ import annotations

import os
from dataclasses import replace

from starlette.responses import Response

from prepos.chat.conversation import check_order
from prepos.core import Request as EngineRequest
from prepos.core import SamplingParams
from prepos.engine import AGENTIC, STREAMING, TURN, SessionSpec, query_key
from prepos.errors import InvalidInput, InvalidResponseFormat, PreposError
from prepos.server.conversation_request import ConversationRequest
from prepos.server.http.arrival import entered
from prepos.server.http.cluster_front import SESSION_ID
from prepos.server.http.errors import ApiError
from prepos.server.http.forwarding import hop
from prepos.server.http.idempotency import attempt_of
from prepos.server.http.request_bodies import Completion
from prepos.server.http.state import ServerState
from prepos.server.names import public
from prepos.server.openai.chat_reply import CompletionReply
from prepos.server.openai.checks import forced_call


def choice_sampling(sampling: SamplingParams, i: int) -> SamplingParams:
    """Choice i of n: its own seed (seed + i), so seeded choices differ and reproduce."""
    if i == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=(sampling.seed + i) % 2**64)


def _continuation_prompt(fmt, text: str) -> str:
    """A rendered conversation as a raw prompt: without the BOS text the tokenizer adds to a
    raw prompt itself, so it is not there twice."""
    bos = getattr(fmt.tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        ids = fmt.encode_prompt("x")
        if ids and ids != fmt.encode("x"):
            return text[len(bos):]
    return text


class ChatCall:
    """One conversation request being answered: `reply` is its API's (chat completions',
    the Messages API's or the Responses API's), told by the flow how to parse the answer
    (`sid`, `agentic`, `tools`, `prefix`, `forced`, `parallel`) and then asked to
    `respond(receive, streams, cleanup)`."""

    def __init__(self, state: ServerState, conv: ConversationRequest, request, reply):
        self.state = state
        self.receive = request.receive  # a client that leaves cancels its stream
        self.origin = attempt_of(request)  # handed to the engine with every commit
        self.scope = request.scope  # its arrival ends once its engine entry returns
        self.conv = conv
        self.reply = reply
        self.sampling = conv.sampling
        self.n = conv.n
        self.forced: dict[str, str] | None = None  # a forced call's openings, by function

    @property
    def choice(self) -> str:
        return self.conv.choice

    @staticmethod
    def constrains(eng) -> bool:
        """Whether the back end samples in process, so a grammar can constrain a call."""
        return eng.samples_in_process

    def _constrained(self, eng, msgs: list[dict], tools: list[dict]) -> bool:
        """tool_choice 'required' or named, where the back end samples in process: the
        call is constrained by its grammar and the turn ends when it closes (True);
        elsewhere it is an unconstrained continuation of the call's opening (False)."""
        if self.choice in ("auto", "none") or not self.constrains(eng):
            return False
        grammar, self.forced = forced_call(eng, msgs, tools, self.choice,
                                           parallel=self.conv.parallel)
        self.sampling = replace(self.sampling, grammar=grammar)
        try:  # compiled now: a call this model's vocabulary cannot write is refused by name
            eng.check_grammar(self.sampling)
        except InvalidResponseFormat as exc:
            raise ApiError(400, "unsupported", f"{exc}: tool_choice must be 'auto' or 'none'",
                           "tool_choice") from None
        return True

    def _req(self, sampling: SamplingParams, fast_path: str | None = None) -> EngineRequest:
        return EngineRequest(sampling, fast_path, self.conv.logprobs, origin=self.origin)

    async def _respond(self, streams, sid: str | None, agentic: bool, tools: bool,
                       cleanup=None, prefix: str = "",
                       forced: dict[str, str] | None = None) -> Response:
        r = self.reply
        r.sid, r.agentic, r.tools, r.prefix = sid, agentic, tools, prefix
        r.forced, r.parallel = forced or self.forced, self.conv.parallel
        return await r.respond(self.receive, streams, cleanup)

    async def stateless(self, eng, owner, msgs: list[dict], tools: list[dict]) -> Response:
        continued = msgs[-1]["role"] == "assistant"
        check_order([], msgs, 0, continue_final=True)
        if self.choice == "none":
            tools = []  # the model is not told of them, and nothing is parsed as a call
        kept = self.n == 1 and eng.keeps_conversations
        forced = self.choice not in ("auto", "none")
        if continued or forced and not (kept and self.constrains(eng)):
            return await self._continue(eng, owner, msgs, tools)
        if kept:  # a forced call too, constrained and committed there as on any session:
            # continued on the kept session it extends, paying its delta only, or on a new
            # one kept for its next turn (`Engine.converse`)
            try:
                self.sampling = self._session_sampling(eng, None, tools, msgs)
                req = self._req(self.sampling, self.conv.fast_path)
                eng.admit()
                stream = await self.state.run(entered(self.scope, eng.converse), owner, msgs,
                                              tools, req)
                return await self._respond([stream], None, agentic=True,
                                           tools=bool(tools) and self.choice != "none")
            except (ApiError, PreposError) as exc:
                if not forced or exc.code not in ("over_budget", "context_length_exceeded"):
                    raise
                # a call its session's reserve leaves no room for: a raw completion, whose
                # room is the whole context
                return await self._continue(eng, owner, msgs, tools)
        eng.admit()
        system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
        spec = SessionSpec(AGENTIC, system, tuple(tools), (), "off", False, None, owner=owner)
        sids, streams = [], []
        try:
            for i in range(self.n):
                sampling = choice_sampling(self.sampling, i)
                sid, stream = await self.state.run(
                    entered(self.scope, self.state.admission.start_ephemeral), eng, spec,
                    lambda sid, sp=sampling: eng.turn(sid, None, self._req(sp, "off")),
                    [(0, msgs)])
                sids.append(sid)
                streams.append(stream)
        except BaseException:
            for stream in streams:
                stream.cancel()
            self._close_all(eng, streams, sids)
            raise
        return await self._respond(streams, None, agentic=bool(tools), tools=bool(tools),
                                   cleanup=lambda: self._close_all(eng, streams, sids))

    def _close_all(self, eng, streams, sids) -> None:
        for stream, sid in zip(streams, sids):
            self.state.admission.close_after(eng, stream, sid)

    async def _continue(self, eng, owner, msgs: list[dict], tools: list[dict]) -> Response:
        """The continuation of the final assistant message, or a forced tool call (its
        grammar, or its opening continued): a raw completion of the rendered
        conversation."""
        fmt = eng.fmt
        for i, m in enumerate(msgs):
            fmt.check_text(m["content"], f"messages[{i}].content")
        forced = None
        try:
            if msgs[-1]["role"] == "assistant":
                if self.choice not in ("auto", "none"):
                    raise ApiError(400, "invalid_request", "a conversation that ends with an "
                                   "assistant message is continued: tool_choice must be "
                                   "'auto' or 'none'", "tool_choice")
                if self.sampling.response_format is not None:  # its start is the client's
                    raise ApiError(400, "invalid_request", "response_format constrains a whole "
                                   "answer: a conversation that ends with an assistant "
                                   "message is not continued under it", "response_format")
                full = fmt.render(msgs, tools)
                content = msgs[-1]["content"]
                content = fmt.defuse(content.strip() if fmt.trims_content else content)
                at = full.rfind(content) if content else -1
                if at < 0:  # nothing to continue: answer after the conversation so far
                    text = fmt.render(msgs[:-1], tools, generation_prompt=True)
                else:
                    text = full[:at + len(content)]
                prefix = ""
            elif self._constrained(eng, msgs, tools):  # the grammar writes the whole call
                text, prefix = fmt.render(msgs, tools, generation_prompt=True), ""
            else:  # the openings the calls share, continued
                _, forced = forced_call(eng, msgs, tools, self.choice, grammar=False)
                openings = [fmt.call_markup(msgs, tools, name).opening for name in forced]
                prefix = os.path.commonprefix(openings)
                text = fmt.render(msgs, tools, generation_prompt=True) + prefix
                prefix = os.path.commonprefix(list(forced.values()))  # as the answer shows it
        except InvalidInput as exc:
            raise ApiError(400, "invalid_input", str(exc), "messages") from None
        prompt = _continuation_prompt(fmt, text)
        eng.admit()
        # a raw completion, never committed: the context is all its room
        spec = SessionSpec(STREAMING, None, (), (), "off", False, None, owner=owner)
        streams: list = []

        def start(sid):
            for i in range(self.n):
                streams.append(eng.complete(sid, prompt,
                                            self._req(choice_sampling(self.sampling, i))))
            return streams[-1]

        sid, _ = await self.state.run(entered(self.scope, self.state.admission.start_ephemeral),
                                      eng, spec, start)
        return await self._respond(streams, None, agentic=bool(tools), tools=bool(tools),
                                   cleanup=lambda: self.state.admission.close_after(
                                       eng, streams[-1], sid),
                                   prefix=prefix, forced=forced)

    async def streaming(self, eng, s, msgs: list[dict]) -> Response:
        """A streaming session's query, asked as one user message."""
        asked = [m for m in msgs if m["role"] != "system"]
        if len(asked) != 1 or asked[0]["role"] != "user":
            name = public(s.id)
            raise ApiError(400, "invalid_request", f"session {name} is a streaming session: a "
                           "chat request asks one user message (the query); data is appended "
                           f"with POST /sessions/{name}/append", "messages")
        if msgs[0]["role"] == "system" and msgs[0]["content"] != (s.spec.system or ""):
            raise ApiError(409, "conversation_diverged", f"the system message differs from "
                           f"session {public(s.id)}'s", "messages[0]")
        if self.choice not in ("auto", "none"):
            raise ApiError(400, "invalid_request", f"session {public(s.id)} is a streaming "
                           "session: it has no tools to call", "tool_choice")
        question = asked[0]["content"]
        mode = self.conv.fast_path
        streams = []
        for i in range(self.n):  # each from the same ready distribution when one is cached
            req = self._req(choice_sampling(self.sampling, i), mode)
            streams.append(await self.state.start_exact(
                eng, s.id, query_key(question), req,
                entered(self.scope, lambda req=req: eng.query(s.id, question, req)),
                len(question)))
        return await self._respond(streams, s.id, agentic=False, tools=False)

    def _session_sampling(self, eng, sid: str | None, tools, msgs: list[dict]) -> SamplingParams:
        """An agentic session's sampling with its tool choice: 'none' forbids the token that
        opens a tool call (a logit bias, so the cached distribution obeys it too); a forced
        call ('required', a function) is constrained by its grammar, as statelessly, and
        committed as generated. `sid`: the session (None: a kept conversation's)."""
        if self.n != 1:
            raise ApiError(400, "invalid_request", f"session {public(sid)} commits one answer per "
                           "turn: n must be 1 (n > 1 works statelessly and on streaming "
                           "sessions)", "n")
        tools = list(tools)
        if self.choice == "auto" or not tools:
            return self.sampling
        if self._constrained(eng, msgs, tools):
            return self.sampling
        if self.choice == "none":
            held = list(eng.snapshot(sid).messages) if sid is not None else msgs
            try:
                opening = eng.fmt.call_markup(held, tools, tools[0]["function"]["name"]).opening
            except InvalidInput as exc:
                raise ApiError(400, "unsupported", f"{exc}: tool_choice must be 'auto'",
                               "tool_choice") from None
            ids = eng.fmt.encode(opening.strip())
            if ids:
                bias = dict(self.sampling.logit_bias)
                bias[ids[0]] = -100.0
                return replace(self.sampling, logit_bias=tuple(bias.items()))
        raise ApiError(400, "unsupported", f"the {eng.backend_name} back end samples "
                       "itself, so a forced call cannot be constrained on a session: "
                       "tool_choice must be 'auto' or 'none' ('required' and named "
                       "functions work statelessly)", "tool_choice")

    async def agentic(self, eng, s, msgs: list[dict], cleanup=None) -> Response:
        """Delta-only: commit what the session lacks, then answer; `cleanup(stream)` runs
        once it is out."""
        self.sampling = sampling = self._session_sampling(eng, s.id, s.spec.tools, msgs)
        plan = eng.plan_chat(s.id, msgs, rollback=self.conv.rollback)
        req = self._req(sampling, self.conv.fast_path)
        tools = bool(s.spec.tools) and self.choice != "none"
        if plan.commits_nothing and (
                eng.will_be_fast(s.id, TURN, req)
                # a streamed exact turn that decodes on: its first token is out at once
                or self.conv.stream and eng.serves_exact(s.id, TURN, req)):
            stream = await self.state.committing(entered(self.scope, eng.chat), plan, req)
        else:
            eng.admit()
            stream = await self.state.run(entered(self.scope, eng.chat), plan, req)
        return await self._respond([stream], s.id, agentic=True, tools=tools,
                                   cleanup=cleanup and (lambda: cleanup(stream)))


def named(state: ServerState, eng, sid: str | None, owner):
    """The key's session `sid` names; None for none named, or a name that is no session of
    this key's (400 where it is no valid name)."""
    if sid is None:
        return None
    s = state.session_named(eng, sid, owner)
    if s is None and not SESSION_ID.fullmatch(sid):
        raise ApiError(400, "invalid_session_id", "session_id must be 1-128 letters, digits "
                       f"and ._:- (starting with a letter or digit), got {sid[:140]!r}",
                       "session_id")
    return s


async def converse(call: ChatCall, request, eng, owner) -> Response:
    """A conversation sent whole (`call.conv`), answered one way whichever API sent it:
    each message's size checked, then by the session it names: none of the key's,
    statelessly (on the node that keeps the conversation, where another does), else
    `answer` on that session."""
    state, conv = call.state, call.conv
    for i, m in enumerate(conv.messages):
        await state.check_input(eng, m["content"], f"messages[{i}].content", context=True)
    s = named(state, eng, conv.name, owner)
    if s is None:  # a name that is no session of this key's is the client's: stateless
        kept_elsewhere = await hop(state, request, owner, conv.tools, conv.messages)
        if kept_elsewhere is not None:  # kept on another node
            return kept_elsewhere
    return await answer(call, eng, owner, s)


async def answer(call: ChatCall, eng, owner, s, cleanup=None) -> Response:
    """The one dispatch of a conversation whose session is settled (`s`; None: none):
    statelessly, a streaming session's query, or an agentic session's turn with the
    session's tools (`cleanup(stream)` once it is out)."""
    conv = call.conv
    if s is None:
        return await call.stateless(eng, owner, conv.messages, conv.tools)
    if s.kind == STREAMING:
        return await call.streaming(eng, s, conv.messages)
    conv.use_session_tools(public(s.id), s.spec.tools)
    return await call.agentic(eng, s, conv.messages, cleanup)


def prompt_text(eng, prompt: str | list[int], where: str) -> str:
    """A session query's prompt as text: token ids are taken where they are the tokenizer's
    own encoding of their text (a leading BOS may be left out)."""
    if isinstance(prompt, str):
        return prompt
    fmt = eng.fmt
    try:
        text = fmt.tokenizer.decode(list(prompt), skip_special_tokens=False)
        back = fmt.encode_prompt(text)
    except Exception as exc:
        raise ApiError(400, "invalid_request", f"{where}: token ids the tokenizer cannot "
                       f"decode: {exc}", where) from None
    if list(prompt) != back and [*back[:1], *prompt] != back:
        bos = getattr(fmt.tokenizer, "bos_token", None)
        stripped = text[len(bos):] if bos and text.startswith(bos) else None
        if stripped is None or fmt.encode_prompt(stripped) != list(prompt):
            raise ApiError(400, "invalid_request", f"{where}: these token ids are not the "
                           "tokenizer's encoding of their text, so prepos cannot continue them "
                           "exactly; send the text", where)
        text = stripped
    return text


async def complete(state: ServerState, receive, eng, owner, body: Completion,
                   prompts: list[str | list[int]], sampling, s=None) -> Response:
    """Completions: streaming session `s`'s queries (text), or stateless raw completions of
    text or token ids, each on an ephemeral session."""
    want_lp = body.logprobs is not None
    prompt_lp = bool(body.echo) and want_lp  # the prompt's own logprobs, echoed with it
    n = body.n or 1
    echo = [p if isinstance(p, str) else eng.fmt.tokenizer.decode(p, skip_special_tokens=False)
            for p in prompts] if body.echo else None
    if s is not None:
        if prompt_lp:
            raise ApiError(400, "unsupported", "echo with logprobs is not supported on a "
                           "session's query (stateless completions compute the prompt's "
                           "logprobs)", "echo")
        if s.kind != STREAMING:
            raise ApiError(409, "wrong_session_kind", f"session {public(s.id)} is agentic: "
                           "drive it with /v1/chat/completions", "session_id")
        streams = []
        for prompt in prompts:
            for i in range(n):
                req = EngineRequest(choice_sampling(sampling, i), body.fast_path, want_lp)
                streams.append(await state.start_exact(
                    eng, s.id, query_key(prompt), req,
                    lambda p=prompt, req=req: eng.query(s.id, p, req), len(prompt)))
        return await CompletionReply(state, body, s.id, echo, n).respond(receive, streams)
    eng.admit()
    # stateless: the prompt is continued as given, no chat template (a raw completion)
    spec = SessionSpec(STREAMING, None, (), (), "off", False, None, owner=owner)
    sids, streams = [], []

    def start_all(prompt):
        def start(sid):
            for i in range(n):
                req = EngineRequest(choice_sampling(sampling, i), None, want_lp,
                                    prompt_logprobs=prompt_lp)
                streams.append(eng.complete(sid, prompt, req))
            return streams[-1]
        return start

    def cleanup():
        for k, sid in enumerate(sids):
            state.admission.close_after(eng, streams[(k + 1) * n - 1], sid)

    try:
        for prompt in prompts:
            sid, _ = await state.run(state.admission.start_ephemeral, eng, spec, start_all(prompt))
            sids.append(sid)
    except BaseException:
        for s in streams:
            s.cancel()
        cleanup()
        raise
    return await CompletionReply(state, body, None, echo, n).respond(receive, streams, cleanup)

