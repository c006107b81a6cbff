"""The Responses API's response bodies and stream events, and the Conversations API's
objects, as models for `/openapi.json` (`server/openai/response_objects.py` and
`server/openai/conversations_api.py` write them; `server/http/response_bodies.py` holds the
other routes')."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from prepos.server.http.response_bodies import Body, Extension

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(Body):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any] = Field(default_factory=list)


class OutputItem(Body):
    """A `message` (its `content`, output_text parts) or a `function_call` (`call_id`,
    `name`, `arguments`: a JSON object as text)."""

    id: str
    type: Literal["message", "function_call"]
    status: ItemStatus
    role: Literal["assistant"] | None = None
    content: list[OutputText] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


class InputTokens(Body):
    cached_tokens: int = Field(description="input tokens found in the KV cache (exact)")
    cache_write_tokens: int = Field(description="input tokens prefilled into a kept KV")


class ResponseUsage(Body):
    input_tokens: int
    input_tokens_details: InputTokens
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(description="reasoning_tokens: 0")
    total_tokens: int


class ResponseError(Body):
    code: str
    message: str


class ResponseObject(Body):
    """A response (`openai.types.responses.Response`), as created, retrieved or streamed."""

    id: str = Field(description="resp_...")
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None
    incomplete_details: dict[str, str] | None = Field(
        description="{reason: max_output_tokens} when incomplete")
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    instructions: str | None
    previous_response_id: str | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    store: bool
    metadata: dict[str, str]
    text: dict[str, Any]
    conversation: dict[str, str] | None = Field(None, description="{id}: the conversation "
                                                "its turn was added to")
    prepos: Extension | None = None


class ResponseDeleted(Body):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]


class ConversationObject(Body):
    """A conversation (`openai.types.conversations.Conversation`)."""

    id: str = Field(description="conv_...")
    object: Literal["conversation"]
    created_at: int
    metadata: dict[str, str]


class ConversationDeleted(Body):
    id: str
    object: Literal["conversation.deleted"]
    deleted: Literal[True]


class ConversationItem(Body):
    """An item of a conversation: a `message` (`role`, `content` parts), a `function_call`
    (`call_id`, `name`, `arguments`) or a `function_call_output` (`call_id`, `output`)."""

    id: str
    type: Literal["message", "function_call", "function_call_output"]
    status: ItemStatus
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None


class ConversationItemList(Body):
    object: Literal["list"]
    data: list[ConversationItem]
    first_id: str | None = Field(description="the first item's id (null: none)")
    last_id: str | None = Field(description="the last item's id (null: none)")
    has_more: bool


class ResponseEvent(Body):
    """One event of a streamed response: `type` (its name), `sequence_number`, and the
    fields of its type (OpenAI's `response_*_event`)."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    item: OutputItem | None = None
    output_index: int | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    name: str | None = None
    arguments: str | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None


RESPONSE_EVENTS = {name: ResponseEvent for name in (
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added", "response.output_text.delta", "response.output_text.done",
    "response.content_part.done", "response.output_item.done",
    "response.function_call_arguments.delta", "response.function_call_arguments.done",
    "response.completed", "response.incomplete", "response.failed", "error")}
