"""Request bodies. The session API forbids unknown fields (a typo is an error that names
it); the OpenAI-compatible bodies allow them, the way OpenAI clients expect, and the routes
refuse the few options prepos cannot honour instead of ignoring them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

FastMode = Literal["exact", "relaxed", "off"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingFields(Strict):
    max_tokens: StrictInt | None = None
    temperature: float = 0.0
    top_k: StrictInt = 0
    top_p: float = 1.0
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt = 0  # the k likeliest tokens at each step, 0 to 20
    fast_path: FastMode | None = None
    stream: StrictBool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    response_format: dict[str, Any] | None = None  # as OpenAI's: json_object, json_schema


# -- session API ------------------------------------------------------------------------
class CreateSession(Strict):
    kind: Literal["streaming", "agentic"]
    system: StrictStr | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    standing_queries: list[StrictStr] = Field(default_factory=list)
    fast_path: FastMode = "exact"
    preposition: StrictBool = True
    budget_cells: StrictInt | None = None
    push_max_tokens: StrictInt = 1  # tokens per standing-query answer pushed over SSE
    # the answer budget of its exact entries (standing queries, turns), pre-decoded at idle:
    # at most this many tokens (default: the server's --predecode-tokens, or push_max_tokens
    # where more), up to the first of answer_stop
    answer_max_tokens: StrictInt | None = None
    answer_stop: StrictStr | list[StrictStr] | None = None
    relaxed_queries: list[StrictStr] = Field(default_factory=list)  # classes served relaxed
    r_max: float | None = None  # this session's relaxed risk budget (default: the engine's)
    session_id: StrictStr | None = None  # the new session's id (default: the server's)


class Append(Strict):
    data: StrictStr
    wait: StrictBool = True
    expected_version: StrictInt | None = None  # 409 conflict unless the session is there


class Rollback(Strict):
    version: StrictInt
    wait: StrictBool = True
    expected_version: StrictInt | None = None  # 409 conflict unless the session is there


class Shift(Strict):
    drop: StrictInt | None = None
    wait: StrictBool = True
    expected_version: StrictInt | None = None  # 409 conflict unless the session is there


class Query(SamplingFields):
    question: StrictStr


class Turn(SamplingFields):
    user: StrictStr | None = None
    expected_version: StrictInt | None = None  # 409 conflict unless the session is there


class ToolResult(SamplingFields):
    content: StrictStr
    expected_version: StrictInt | None = None  # 409 conflict unless the session is there


class AddMessage(Strict):
    role: Literal["user", "assistant", "tool"]
    content: StrictStr
    tool_calls: list[dict[str, Any]] | None = None
    wait: StrictBool = True
    expected_version: StrictInt | None = None  # 409 conflict unless the session is there


# -- OpenAI-compatible ------------------------------------------------------------------
class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(Open):
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None


class StreamOptions(Open):
    include_usage: StrictBool = False


class OpenAISampling(Open):
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None  # an extension, as in vLLM
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: StrictStr | None = None
    # prepos extensions
    session_id: StrictStr | None = None
    fast_path: FastMode | None = None


class ChatCompletion(OpenAISampling):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    on_divergence: Literal["error", "rollback"] = "error"  # prepos extension
    # accepted and echoed nowhere: a conversation is found by its content
    prompt_cache_key: StrictStr | None = Field(None, max_length=256)


class Completion(OpenAISampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr | list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class CreateResponse(Open):
    """POST /v1/responses (`server/openai/responses.py`): OpenAI's Responses API. Fields typed
    `Any` are checked by the route, which refuses by name what prepos cannot honour."""

    model: StrictStr
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    store: StrictBool | None = None
    stream: StrictBool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    stream_options: dict[str, Any] | None = None
    include: list[StrictStr] | None = None
    truncation: Any = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    top_logprobs: Any = None
    context_management: Any = None
    moderation: Any = None


class CreateConversation(Open):
    """POST /v1/conversations (`server/openai/conversations_api.py`): initial items, as
    `input`'s."""

    items: list[dict[str, Any]] | None = None
    metadata: dict[str, StrictStr] | None = None


class UpdateConversation(Open):
    metadata: dict[str, StrictStr] | None


class AddItems(Open):
    items: list[dict[str, Any]]
