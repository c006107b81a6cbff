"""Response bodies as pydantic models, for `/openapi.json`: what each route returns, field
for field (`server/http/results.py`, `server/openai/chat_reply.py`, `server/http/sessions.py`
write them).
The routes build their JSON directly (the fast path serializes no model); these models
document it, and the tests validate real responses against their schemas.

Fields a response always has are required; fields it has only sometimes have a default, so
they are optional in the schema. Every model admits fields it does not name (extensions
may add some; a client ignores what it does not know)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PathName = Literal["fast", "fall-through", "cold"]
MatchName = Literal["exact", "relaxed", "none"]
ErrorType = Literal["invalid_request_error", "authentication_error", "permission_error",
                    "rate_limit_error", "service_unavailable", "server_error"]


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- errors -------------------------------------------------------------------------------
class ErrorDetail(Body):
    message: str = Field(description="what was wrong, naming the field or the limit")
    type: ErrorType = Field(description="OpenAI's error class of the status")
    code: str = Field(description="a stable code, e.g. invalid_request, session_not_found")
    param: str | None = Field(description="the field at fault, where there is one")


class ErrorBody(Body):
    """Every failure's body (`server/http/errors.py`)."""

    error: ErrorDetail


# -- health -------------------------------------------------------------------------------
class Health(Body):
    status: Literal["ok"]
    model: str
    sessions: int
    restored: int = Field(description="sessions restored from the journal at start")
    journal: bool
    journal_path: str | None = Field(None, description="to callers with a key only")
    cluster: dict | None = Field(None, description="with a shared store: this node's id, "
                                 "epoch, whether it serves, sessions owned, takeovers, forwards")


class HealthPending(Body):
    status: Literal["loading", "failed", "stopping", "lapsed"]
    model: str
    error: str | None = None
    cluster: dict | None = Field(None, description="a node whose own lease lapsed")


# -- the session API ----------------------------------------------------------------------
class RecordView(Body):
    p: int = Field(description="the decision point: session tokens plus the entry")
    gap: float | None = Field(description="the top-2 logit gap at the decision point")
    token: str = Field(description="the argmax token's text")
    entry_tokens: int


class ReadyView(Body):
    version: int
    valid: bool
    consumed: bool
    done: bool
    records: dict[str, RecordView] = Field(description="by entry key, e.g. query:<text>")


class SessionInfo(Body):
    id: str
    kind: Literal["streaming", "agentic"]
    version: int
    tokens: int
    messages: int
    awaiting_tool_result: bool
    fast_path: str
    standing_queries: list[str]
    ready: ReadyView
    versions_kept: list[int] = Field(description="the oldest and newest version kept")
    push_max_tokens: int
    answer_max_tokens: int = Field(description="the answer budget its exact entries pre-decode "
                                   "at idle (0: none)")
    answer_stop: list[str]
    preposition: bool
    system: str | None
    tools: list[dict[str, Any]]
    relaxed: dict[str, Any] | None = Field(None, description="the relaxed gate's view")
    token_ids: list[int] | None = Field(None, description="with include=tokens")
    message_list: list[dict[str, Any]] | None = Field(None, description="with include=messages")


class SessionSummary(Body):
    id: str
    kind: Literal["streaming", "agentic"]
    version: int
    tokens: int
    messages: int


class SessionList(Body):
    object: Literal["list"]
    data: list[SessionSummary]


class Committed(Body):
    """A mutation's result: the version it committed."""

    session_id: str
    version: int
    tokens: int
    messages: int


class Closed(Body):
    session_id: str
    closed: Literal[True]


class TimingView(Body):
    queue_ms: float
    restore_ms: float
    prefill_ms: float
    ttft_ms: float
    total_ms: float
    prefill_tokens: int
    cached_tokens: int


class SessionUsage(Body):
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


class Answer(Body):
    """A query's answer, with the path that served it."""

    session_id: str
    text: str
    tokens: list[int]
    finish_reason: str = Field(description="length, stop, eos, fast_path or cancelled")
    path: PathName
    match: MatchName
    gap: float | None
    version: int = Field(description="the committed version the answer was computed from")
    answer_id: str | None = Field(description="a relaxed answer's id, which a correction "
                                  "event names if its verification disagrees")
    timing: TimingView
    predecoded: int = Field(description="of the answer's tokens, those served from its answer "
                            "pre-decoded at idle")
    usage: SessionUsage
    logprobs: list[float] | None = Field(None, description="with logprobs: true")
    top_logprobs: list[list[tuple[int, float]]] | None = Field(
        None, description="[token id, logprob] pairs per token, with top_logprobs > 0")


class AgenticAnswer(Answer):
    """A turn's or tool result's answer: its text without tool-call markup, its tool
    calls, and the version that committed it."""

    content: str
    tool_calls: list[dict[str, Any]]
    committed_version: int


class TokenEvent(Body):
    text: str
    token: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None = None


class HelloEvent(Body):
    session_id: str
    version: int
    tokens: int
    standing_queries: list[str]
    after: int | None = Field(description="the Last-Event-ID the stream resumes after: "
                              "each commit since is sent next (null: a new subscription)")


class CommitEvent(Body):
    session_id: str
    version: int
    tokens: int
    messages: int


class ReadyEvent(Body):
    session_id: str
    key: str
    version: int
    p: int
    gap: float | None


class StandingAnswerEvent(Body):
    session_id: str
    query: str
    version: int
    text: str
    tokens: list[int]
    finish_reason: str
    path: PathName
    match: MatchName
    gap: float | None
    ttft_ms: float
    predecoded: int = Field(description="of its tokens, those pre-decoded at idle")


class CorrectionEvent(Body):
    """A relaxed answer whose verification (the full forward) chose another token."""

    session_id: str
    answer_id: str
    version: int
    question: str
    class_: str = Field(alias="class")
    served_token: int
    served_text: str
    full_token: int
    full_text: str


class CloseEvent(Body):
    session_id: str


class EndEvent(Body):
    """The stream ends while its session lives on (elsewhere, or here after a restart):
    subscribe again with `Last-Event-ID`."""

    session_id: str
    reason: Literal["shutdown", "lease_lost", "moved", "too_slow"]
    detail: str


# -- OpenAI-compatible --------------------------------------------------------------------
class Model(Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(Body):
    object: Literal["list"]
    data: list[Model]


class PromptDetails(Body):
    cached_tokens: int


class Usage(Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptDetails


class Extension(Body):
    """The `prepos` field: the path that served the answer, and its timing."""

    path: PathName
    match: MatchName
    gap: float | None
    version: int
    session_id: str | None
    timing: TimingView
    predecoded: int = Field(description="of the answer's tokens, those served pre-decoded")
    answer_id: str | None = Field(None, description="a relaxed answer's id")
    choices: list[Extension] | None = Field(None, description="each choice's, with n > 1")


class FunctionCall(Body):
    name: str
    arguments: str = Field(description="a JSON object, as text")


class ToolCall(Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class TopLogprob(Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Body):
    content: list[TokenLogprob]


class ChatMessageOut(Body):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Body):
    index: int
    message: ChatMessageOut
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None
    prepos: Extension


class ToolCallDelta(ToolCall):
    index: int


class ChatDelta(Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Body):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(Body):
    """One streamed chunk; the last names the path (`prepos`), and with
    stream_options.include_usage a final chunk with no choices carries `usage`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prepos: Extension | None = None


class CompletionLogprobs(Body):
    """The legacy completions format: per token its text, logprob, offset in the choice's
    text, and (with logprobs >= 0) a map of the likeliest tokens' texts to logprobs that
    always holds the sampled token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Body):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None


class CompletionResponse(Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    prepos: Extension


class CompletionChunk(Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prepos: Extension | None = None


DONE = "[DONE]"  # the data of an OpenAI stream's last event

# -- event streams: each event's name and its data (`server/http/openapi.py`) --------------------
ANSWER_EVENTS = {"token": TokenEvent, "result": Answer, "error": ErrorBody}
AGENTIC_EVENTS = {"token": TokenEvent, "result": AgenticAnswer, "error": ErrorBody}
SESSION_EVENTS = {"hello": HelloEvent, "commit": CommitEvent, "ready": ReadyEvent,
                  "answer": StandingAnswerEvent, "correction": CorrectionEvent,
                  "close": CloseEvent, "end": EndEvent}
CHAT_EVENTS = {"message": (ChatCompletionChunk, ErrorBody, DONE)}
COMPLETION_EVENTS = {"message": (CompletionChunk, ErrorBody, DONE)}
