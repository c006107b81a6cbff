"""Input checks of the OpenAI endpoints, before any engine call: the model name, options
prepos does not support (refused by name, never ignored), sampling and logprobs ranges,
response_format, tools, the prompt. Each returns what the flow needs: sampling parameters,
tools, prompt."""

from __future__ import annotations

from dataclasses import replace

from prepos.core import SamplingParams
from prepos.engine import valid_ids
from prepos.errors import InvalidInput, InvalidResponseFormat
from prepos.response_format import canonical, schema_error
from prepos.server.http.errors import ApiError
from prepos.server.http.request_bodies import ChatCompletion, Completion, OpenAISampling

MAX_N = 16  # choices (or prompts times choices) per request


def logit_bias(engine, raw: dict | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token ids (as JSON object keys) of this model's vocabulary, each
    to a bias in [-100, 100]."""
    if not raw:
        return ()
    vocab = engine.vocab_size
    out, bad_keys, bad_values = [], [], []
    for key, bias in raw.items():
        try:
            tok = int(key)
        except ValueError:
            tok = -1
        if not 0 <= tok < vocab or str(tok) != key.strip():
            bad_keys.append(repr(key))
        elif not -100.0 <= bias <= 100.0:  # NaN fails too
            bad_values.append(f"{bias} for token {tok}")
        else:
            out.append((tok, float(bias)))
    problems = []
    if bad_keys:  # every bad key named, so a client fixes them at once
        problems.append(f"keys must be token ids in [0, {vocab}), got {', '.join(bad_keys)}")
    if bad_values:
        problems.append(f"values must be in [-100, 100], got {', '.join(bad_values)}")
    if problems:
        raise ApiError(400, "invalid_request", f"logit_bias {'; '.join(problems)}",
                       "logit_bias")
    return tuple(out)


INT64 = (-(2**63), 2**63 - 1)  # OpenAI's seed: a signed 64-bit integer


def check_seed(seed: int | None) -> None:
    """A seed within int64, refused in OpenAI's words otherwise."""
    if seed is not None and seed > INT64[1]:
        raise ApiError(400, "integer_above_max_value", f"Invalid 'seed': integer above "
                       f"maximum value. Expected a value <= {INT64[1]}, but got {seed} "
                       "instead.", "seed")
    if seed is not None and seed < INT64[0]:
        raise ApiError(400, "integer_below_min_value", f"Invalid 'seed': integer below "
                       f"minimum value. Expected a value >= {INT64[0]}, but got {seed} "
                       "instead.", "seed")


def check_common(state, body: OpenAISampling) -> None:
    if body.model != state.model_name:
        raise ApiError(404, "model_not_found", f"model {body.model!r} is not served here; this "
                       f"server serves {state.model_name!r}", "model")
    check_seed(body.seed)
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise ApiError(400, "invalid_request", f"n must be in [1, {MAX_N}], got {body.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(body, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise ApiError(400, "invalid_request", f"{name} must be in [-2, 2], got {v}", name)
    shaped = body.logit_bias or body.presence_penalty or body.frequency_penalty
    if shaped and state.engine.streams_answers:
        raise ApiError(400, "unsupported", f"the {state.engine.backend_name} back end samples "
                       "on the remote engine: logit_bias and penalties are not supported there",
                       "logit_bias" if body.logit_bias else "presence_penalty")
    if body.stop is not None and not isinstance(body.stop, str) and len(body.stop) > 4:
        raise ApiError(400, "invalid_request", "at most 4 stop sequences", "stop")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "invalid_request", "stream_options is only allowed with stream: "
                       "true", "stream_options")


def _sampling(state, body: OpenAISampling, max_tokens, param: str, top: int):
    return state.limits.sampling(
        max_tokens, body.temperature, body.top_k, body.top_p, body.seed, body.stop,
        param=param, top_logprobs=top, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=logit_bias(state.engine, body.logit_bias), fit=True)


def chat_sampling(state, body: ChatCompletion) -> SamplingParams:
    """The sampling of a chat request, after its chat-only options are checked."""
    check_common(state, body)
    fmt = response_format(state, body)
    top = body.top_logprobs
    if top is not None and not 0 <= top <= 20:
        raise ApiError(400, "invalid_request", f"top_logprobs must be in [0, 20], got {top}",
                       "top_logprobs")
    if top and not body.logprobs:
        raise ApiError(400, "invalid_request", "top_logprobs needs logprobs: true",
                       "top_logprobs")
    if body.max_completion_tokens is not None:
        sampling = _sampling(state, body, body.max_completion_tokens, "max_completion_tokens",
                             top or 0)
    else:
        sampling = _sampling(state, body, body.max_tokens, "max_tokens", top or 0)
    return replace(sampling, response_format=fmt) if fmt is not None else sampling


def response_format(state, body: ChatCompletion) -> str | None:
    """The request's response_format in canonical form (None for text), refused where it
    is malformed, not enforceable, on a back end that samples answers itself, or beside a
    tool choice that forces a tool call."""
    try:
        fmt = canonical(body.response_format) if body.response_format is not None else None
    except InvalidResponseFormat as exc:
        raise ApiError(400, "invalid_request", str(exc), "response_format") from None
    if fmt is None:
        return None
    if not state.engine.samples_in_process:
        raise ApiError(400, "unsupported", f"the {state.engine.backend_name} back end samples "
                       "answers on the remote engine: response_format (constrained decoding) "
                       "is not supported there", "response_format")
    if body.tool_choice not in (None, "auto", "none"):  # checked by name in `tool_choice`
        raise ApiError(400, "invalid_request", f"response_format constrains the answer's text: "
                       f"tool_choice must be 'auto' or 'none', got {body.tool_choice!r}",
                       "response_format")
    return fmt


def forced_call(engine, msgs: list[dict], tools: list[dict], choice: str,
                grammar: bool = True, parallel: bool = False
                ) -> tuple[str | None, dict[str, str]]:
    """tool_choice 'required' or a function's name: a grammar of one call (of that function,
    or of any tool; with `parallel` and 'required', one or more calls where the template
    writes them one after another), written in the template's markup, its arguments valid
    JSON of the function's parameter schema (enforced strictly where the tool says
    `strict`, else its unsupported keywords ignored); and each function's opening as the
    answer's text shows it (its special tokens left out), by name. Without `grammar` (a
    back end that samples itself), the openings alone."""
    fmt = engine.fmt
    calls = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if choice != "required" and fn["name"] != choice:
            continue
        where = f"tools[{i}].function.parameters"
        schema = fn.get("parameters") or {"type": "object"}
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise ApiError(400, "invalid_request", f"{where} must be a JSON Schema of an "
                           "object (a call's arguments are one)", where)
        schema = {"type": "object", **schema}
        strict = fn.get("strict") is True
        error = schema_error(schema, strict) if grammar else ""
        if error:
            raise ApiError(400, "invalid_request", f"{where} cannot be enforced on a forced "
                           f"call{' (strict)' if strict else ''}: {error}", where)
        try:
            markup = fmt.call_markup(msgs, tools, fn["name"])
        except InvalidInput as exc:
            raise ApiError(400, "unsupported", f"{exc}: tool_choice must be 'auto' or 'none'",
                           "tool_choice") from None
        calls.append((markup, schema, strict))
    shown = {m.name: "".join(p for p in fmt.controls.split_special(m.opening)
                             if isinstance(p, str)) for m, _, _ in calls}
    if not grammar:
        return None, shown
    sep = fmt.call_separator(msgs, tools) if parallel and choice == "required" else None
    return fmt.call_grammar(calls, sep), shown


def tool_specs(body: ChatCompletion) -> list[dict]:
    tools = body.tools or []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict) or \
                not isinstance(tool["function"].get("name"), str):
            raise ApiError(400, "invalid_request", f"tools[{i}] must be {{'type': 'function', "
                           "'function': {'name': ..., ...}}", f"tools[{i}]")
    return list(tools)


def completion_input(state, body: Completion) -> tuple[list[str | list[int]],
                                                     SamplingParams]:
    """The prompts (text, or token ids) and sampling of a completions request, after its
    options are checked."""
    check_common(state, body)
    if body.best_of not in (None, 1) and body.best_of != body.n:
        raise ApiError(400, "unsupported", f"best_of must be 1 (or equal n): prepos returns "
                       f"every choice it generates, got best_of {body.best_of}", "best_of")
    if body.suffix:
        raise ApiError(400, "unsupported", "suffix is not supported", "suffix")
    prompt = body.prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or len(prompts) > MAX_N:
        raise ApiError(400, "invalid_request", f"prompt must be a string, a list of token ids, "
                       f"or a list of 1 to {MAX_N} of those", "prompt")
    vocab = state.engine.vocab_size
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p.strip():
                raise ApiError(400, "invalid_request", f"{where} must not be empty", where)
            continue
        if not valid_ids(p, vocab):
            raise ApiError(400, "invalid_request", f"{where}: token ids must be a non-empty "
                           f"list of integers in [0, {vocab})", where)
    if len(prompts) * (body.n or 1) > MAX_N:
        raise ApiError(400, "invalid_request", f"prompts times n must be at most {MAX_N}", "n")
    if body.logprobs is not None and not 0 <= body.logprobs <= 5:
        raise ApiError(400, "invalid_request", f"logprobs must be in [0, 5], got "
                       f"{body.logprobs}", "logprobs")
    return prompts, _sampling(state, body, body.max_tokens, "max_tokens", body.logprobs or 0)
