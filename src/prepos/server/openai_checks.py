"""Input checks of the OpenAI endpoints, before any engine call: the model name, options
prepos does not support (refused by name, never ignored), sampling and logprobs ranges,
tools, the prompt. Each returns what the flow needs: sampling parameters, tools, prompt."""

from __future__ import annotations

from prepos.core import SamplingParams
from prepos.server.errors import ApiError
from prepos.server.schemas import ChatCompletion, Completion, OpenAISampling


def check_common(state, body: OpenAISampling) -> None:
    if body.model != state.model_name:
        raise ApiError(404, "model_not_found", f"model {body.model!r} is not served here; this "
                       f"server serves {state.model_name!r}", "model")
    if body.n not in (None, 1):
        raise ApiError(400, "unsupported", f"n must be 1, got {body.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise ApiError(400, "unsupported", f"{name} is not supported (must be 0)", name)
    if body.logit_bias:
        raise ApiError(400, "unsupported", "logit_bias is not supported", "logit_bias")
    if body.stop is not None and not isinstance(body.stop, str) and len(body.stop) > 4:
        raise ApiError(400, "invalid_request", "at most 4 stop sequences", "stop")


def chat_sampling(state, body: ChatCompletion) -> SamplingParams:
    """The sampling of a chat request, after its chat-only options are checked."""
    check_common(state, body)
    response_format = body.response_format
    if response_format and response_format.get("type") not in (None, "text"):
        raise ApiError(400, "unsupported", "response_format must be text", "response_format")
    if body.tool_choice not in (None, "auto") and not (body.tool_choice == "none"
                                                        and not body.tools):
        raise ApiError(400, "unsupported", "tool_choice must be 'auto' (the model decides)",
                       "tool_choice")
    top = body.top_logprobs
    if top is not None and not 0 <= top <= 20:
        raise ApiError(400, "invalid_request", f"top_logprobs must be in [0, 20], got {top}",
                       "top_logprobs")
    if top and not body.logprobs:
        raise ApiError(400, "invalid_request", "top_logprobs needs logprobs: true",
                       "top_logprobs")
    limit_name = "max_completion_tokens" if body.max_completion_tokens is not None else \
        "max_tokens"
    return state.limits.sampling(
        body.max_completion_tokens if body.max_completion_tokens is not None else
        body.max_tokens, body.temperature, body.top_k, body.top_p, body.seed, body.stop,
        param=limit_name, top_logprobs=top or 0)


def tool_specs(body: ChatCompletion) -> list[dict]:
    tools = body.tools or []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict) or \
                not isinstance(tool["function"].get("name"), str):
            raise ApiError(400, "invalid_request", f"tools[{i}] must be {{'type': 'function', "
                           "'function': {'name': ..., ...}}", f"tools[{i}]")
    return list(tools)


def completion_input(state, body: Completion) -> tuple[str, SamplingParams]:
    """The prompt and sampling of a completions request, after its options are checked."""
    check_common(state, body)
    if body.echo:
        raise ApiError(400, "unsupported", "echo is not supported", "echo")
    if body.best_of not in (None, 1):
        raise ApiError(400, "unsupported", "best_of must be 1", "best_of")
    if body.suffix:
        raise ApiError(400, "unsupported", "suffix is not supported", "suffix")
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, "unsupported", "prompt must be one string", "prompt")
        prompt = prompt[0]
    if not prompt.strip():
        raise ApiError(400, "invalid_request", "prompt must not be empty", "prompt")
    if body.logprobs is not None and not 0 <= body.logprobs <= 5:
        raise ApiError(400, "invalid_request", f"logprobs must be in [0, 5], got "
                       f"{body.logprobs}", "logprobs")
    sampling = state.limits.sampling(body.max_tokens, body.temperature, body.top_k,
                                     body.top_p, body.seed, body.stop,
                                     top_logprobs=body.logprobs or 0)
    return prompt, sampling
