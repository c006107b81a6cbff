"""The Messages API's bodies as pydantic models: the requests the routes parse, and the
message, token count, events and errors they answer, for `/openapi.json` and the tests that
validate real responses against it (as `server/http/response_bodies.py` documents the other routes).

Requests admit fields they do not name (a client's newer options are accepted and
ignored, `routes.py`); the fields these clients are known to send are named, typed `Any`
where they are ignored, so no value of theirs is refused."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr

from prepos.server.http.request_bodies import Open
from prepos.server.http.response_bodies import Body

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
ErrorType = Literal["invalid_request_error", "authentication_error", "permission_error",
                    "not_found_error", "request_too_large", "rate_limit_error", "api_error",
                    "overloaded_error"]


# -- requests -----------------------------------------------------------------------------
class AnthropicCountTokens(Open):
    """POST /v1/messages/count_tokens: a conversation, counted as it would be prompted."""

    model: StrictStr
    messages: list[dict[str, Any]] = Field(
        description="user and assistant messages (a system one is accepted too), content a "
                    "string or text, tool_use and tool_result blocks")
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    # accepted and ignored (routes.py)
    thinking: Any = None
    context_management: Any = None
    output_config: Any = None
    mcp_servers: Any = None
    betas: Any = None
    container: Any = None
    service_tier: Any = None


class AnthropicMessages(AnthropicCountTokens):
    """POST /v1/messages: Anthropic's Messages API (`server/anthropic/routes.py`)."""

    max_tokens: StrictInt
    stop_sequences: list[StrictStr] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    stream: StrictBool | None = None
    metadata: dict[str, Any] | None = None


# -- responses ----------------------------------------------------------------------------
class AnthropicTextBlock(Body):
    type: Literal["text"]
    text: str


class AnthropicToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str = Field(description="toolu_..., which a tool_result's tool_use_id answers")
    name: str
    input: dict[str, Any]


class AnthropicUsage(Body):
    input_tokens: int = Field(description="the prompt's tokens not found in kept KV")
    cache_creation_input_tokens: int = Field(description="always 0: keeping KV costs nothing")
    cache_read_input_tokens: int = Field(description="the prompt's tokens found in kept KV")
    output_tokens: int


class AnthropicMessage(Body):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicTextBlock | AnthropicToolUseBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicTokenCount(Body):
    input_tokens: int


class AnthropicErrorDetail(Body):
    type: ErrorType
    message: str


class AnthropicError(Body):
    """Every failure of the Messages routes: Anthropic's error shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


# -- events -------------------------------------------------------------------------------
class AnthropicMessageStart(Body):
    type: Literal["message_start"]
    message: AnthropicMessage


class AnthropicBlockStart(Body):
    type: Literal["content_block_start"]
    index: int
    content_block: AnthropicTextBlock | AnthropicToolUseBlock


class AnthropicTextDelta(Body):
    type: Literal["text_delta"]
    text: str


class AnthropicJsonDelta(Body):
    type: Literal["input_json_delta"]
    partial_json: str


class AnthropicBlockDelta(Body):
    type: Literal["content_block_delta"]
    index: int
    delta: AnthropicTextDelta | AnthropicJsonDelta


class AnthropicBlockStop(Body):
    type: Literal["content_block_stop"]
    index: int


class AnthropicStop(Body):
    stop_reason: StopReason | None
    stop_sequence: str | None


class AnthropicMessageDelta(Body):
    type: Literal["message_delta"]
    delta: AnthropicStop
    usage: AnthropicUsage


class AnthropicMessageStop(Body):
    type: Literal["message_stop"]


class AnthropicPing(Body):
    type: Literal["ping"]


MESSAGE_EVENTS = {"message_start": AnthropicMessageStart, "ping": AnthropicPing,
                  "content_block_start": AnthropicBlockStart,
                  "content_block_delta": AnthropicBlockDelta,
                  "content_block_stop": AnthropicBlockStop,
                  "message_delta": AnthropicMessageDelta, "message_stop": AnthropicMessageStop,
                  "error": AnthropicError}
