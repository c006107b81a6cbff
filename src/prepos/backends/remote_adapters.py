"""Each serving engine's request and response format, one adapter class per engine:
`VLLMAdapter`, `SGLangAdapter`, `LlamaCppAdapter` (the interface: `remote_protocol`)."""

from __future__ import annotations

from typing import Callable

from prepos.backends.remote_protocol import (
    Adapter,
    EngineInfo,
    HttpCall,
    RemoteError,
    StreamParser,
    TopK,
    _log,
    _lp,
    _seed,
)


class VLLMAdapter(Adapter):
    """vLLM's OpenAI-compatible `POST /v1/completions` with a token-id prompt.

    Request: `prompt` a list of token ids, `max_tokens: 1`, `temperature: 0`, `logprobs: k`
    and vLLM's `return_tokens_as_token_ids` extension, so `top_logprobs` is keyed
    `"token_id:<id>"` rather than by (ambiguous) token text; `priority` (lower runs earlier
    under `--scheduling-policy priority`) for background work when configured. Response:
    `choices[0].logprobs.top_logprobs[0]` (up to k+1 entries: the sampled token is always
    included); cached prompt tokens in `usage.prompt_tokens_details.cached_tokens` when the
    server runs with `--enable-prompt-tokens-details`. vLLM aborts a request whose client
    disconnects; there is no separate abort endpoint.

    Streamed answers: the same endpoint with `stream: true`, `max_tokens`, `stop_token_ids`
    and `ignore_eos: true` (so the answer stops exactly on prepos's stop tokens, the model's
    EOS among them, not on a generation config's), every sampling knob sent explicitly
    (`temperature`, `top_k` 0 = off, `top_p`, `min_p: 0`, no penalties: the model's
    generation config would otherwise supply defaults), `seed` when set, and
    `stream_options.include_usage` for the final event's cache report. Each event's
    `choices[0].logprobs` lists the new tokens ("token_id:<id>") and their top-k; a stop
    token is delivered (`finish_reason: "stop"`, `stop_reason: <id>`). Logprobs are the raw
    model distribution, before temperature and truncation. Context length: `GET /v1/models`
    `data[0].max_model_len`.
    """

    kind = "vllm"
    health_path = "/health"

    def request(self, prompt, k, *, rid, background, slot=None) -> HttpCall:
        body: dict = {"prompt": list(prompt), "max_tokens": 1, "temperature": 0.0,
                      "logprobs": k, "return_tokens_as_token_ids": True, "stream": False}
        if self.model:
            body["model"] = self.model
        if background and self.background_priority is not None:
            body["priority"] = self.background_priority
        return HttpCall("POST", "/v1/completions", body, {"X-Request-Id": rid})

    def parse(self, body) -> TopK:
        try:
            choice = body["choices"][0]
            top = choice["logprobs"]["top_logprobs"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise RemoteError(f"vLLM response has no top_logprobs: {exc!r}") from exc
        ids, lps = _token_id_keys(top)
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return TopK(ids, lps, details.get("cached_tokens"), usage.get("prompt_tokens"))

    def stream_request(self, prompt, k, sampling, max_tokens, stop_ids, *, rid, background,
                       slot=None) -> HttpCall:
        body: dict = {"prompt": list(prompt), "max_tokens": int(max_tokens),
                      "temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
                      "top_k": int(sampling.top_k), "min_p": 0.0, "repetition_penalty": 1.0,
                      "presence_penalty": 0.0, "frequency_penalty": 0.0,
                      "stop_token_ids": sorted(stop_ids), "ignore_eos": True,
                      # the token ids come in the logprobs: at least the sampled one's
                      "logprobs": max(k, 1), "return_tokens_as_token_ids": True, "stream": True,
                      "stream_options": {"include_usage": True}}
        if _seed(sampling) is not None:
            body["seed"] = int(sampling.seed)
        if self.model:
            body["model"] = self.model
        if background and self.background_priority is not None:
            body["priority"] = self.background_priority
        return HttpCall("POST", "/v1/completions", body, {"X-Request-Id": rid})

    def stream_parser(self) -> StreamParser:
        return _VLLMStream()

    def info_call(self) -> HttpCall:
        return HttpCall("GET", "/v1/models")

    def parse_info(self, body) -> EngineInfo:
        models = (body or {}).get("data") or []
        ctx = models[0].get("max_model_len") if models else None
        return EngineInfo(max_context=int(ctx) if ctx else None)


def _token_id_keys(top: dict) -> tuple[tuple[int, ...], tuple[float, ...]]:
    ids, lps = [], []
    for key, lp in top.items():
        if not key.startswith("token_id:"):
            raise RemoteError("vLLM returned top_logprobs keyed by text; it must honour "
                              "return_tokens_as_token_ids")
        ids.append(int(key[len("token_id:"):]))
        lps.append(_lp(lp))
    return tuple(ids), tuple(lps)


class _VLLMStream(StreamParser):
    def feed(self, event) -> list[tuple[int, TopK | None]]:
        if "error" in event:
            raise RemoteError(f"vLLM stream error: {event['error']}")
        usage = event.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens")
            self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        out: list[tuple[int, TopK | None]] = []
        for choice in event.get("choices") or []:
            lp = choice.get("logprobs") or {}
            tokens, tops = lp.get("tokens") or [], lp.get("top_logprobs") or []
            if not tokens and choice.get("token_ids"):
                tokens = [f"token_id:{t}" for t in choice["token_ids"]]
            for i, tok in enumerate(tokens):
                if not str(tok).startswith("token_id:"):
                    raise RemoteError("vLLM streamed tokens by text; it must honour "
                                      "return_tokens_as_token_ids")
                top = tops[i] if i < len(tops) and tops[i] else None
                out.append((int(str(tok)[len("token_id:"):]),
                            TopK(*_token_id_keys(top)) if top else None))
            if choice.get("finish_reason") is not None:
                self.finished = True
        self.n += len(out)
        return out


class SGLangAdapter(Adapter):
    """SGLang's native `POST /generate`.

    Request: `input_ids`, `sampling_params: {max_new_tokens: 1, temperature: 0}`,
    `return_logprob: true`, `top_logprobs_num: k`, `logprob_start_len: -1` (no prompt
    logprobs), `rid` (so the request can be aborted with `POST /abort_request {"rid"}`), and
    `priority` for background work when configured (`--enable-priority-scheduling`).
    Response: `meta_info.output_top_logprobs[0]` is a list of `[logprob, token_id, text]`;
    `meta_info.cached_tokens` and `meta_info.prompt_tokens` report the prefix-cache hit.

    Streamed answers: `stream: true` with `max_new_tokens`, `stop_token_ids`, `ignore_eos`,
    `temperature`/`top_k` (-1 = off)/`top_p`/`min_p`, `sampling_seed` when set. Each event
    carries `meta_info.output_token_logprobs`/`output_top_logprobs` either for the whole
    answer so far (SGLang's default) or for the new tokens only
    (`--incremental-streaming-output`); `meta_info.completion_tokens` tells which. Tested
    against a fake of this schema only: SGLang does not install on this project's machines.
    Context length: `GET /v1/models` `data[0].max_model_len`.
    """

    kind = "sglang"
    health_path = "/health"

    def request(self, prompt, k, *, rid, background, slot=None) -> HttpCall:
        body: dict = {"input_ids": list(prompt),
                      "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                      "return_logprob": True, "top_logprobs_num": k, "logprob_start_len": -1,
                      "stream": False, "rid": rid}
        if background and self.background_priority is not None:
            body["priority"] = self.background_priority
        return HttpCall("POST", "/generate", body)

    def parse(self, body) -> TopK:
        if isinstance(body, list):  # a batch answer: one prompt was sent
            body = body[0]
        try:
            meta = body["meta_info"]
            top = meta["output_top_logprobs"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise RemoteError(f"SGLang response has no output_top_logprobs: {exc!r}") from exc
        ids = tuple(int(t[1]) for t in top)
        lps = tuple(_lp(t[0]) for t in top)
        return TopK(ids, lps, meta.get("cached_tokens"), meta.get("prompt_tokens"))

    def stream_request(self, prompt, k, sampling, max_tokens, stop_ids, *, rid, background,
                       slot=None) -> HttpCall:
        sp: dict = {"max_new_tokens": int(max_tokens),
                    "temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
                    "top_k": int(sampling.top_k) or -1, "min_p": 0.0,
                    "stop_token_ids": sorted(stop_ids), "ignore_eos": True}
        if _seed(sampling) is not None:
            sp["sampling_seed"] = int(sampling.seed)
        body: dict = {"input_ids": list(prompt), "sampling_params": sp, "return_logprob": True,
                      "top_logprobs_num": max(k, 1), "logprob_start_len": -1, "stream": True,
                      "rid": rid}
        if background and self.background_priority is not None:
            body["priority"] = self.background_priority
        return HttpCall("POST", "/generate", body)

    def stream_parser(self) -> StreamParser:
        return _SGLangStream()

    def abort(self, rid: str) -> HttpCall:
        return HttpCall("POST", "/abort_request", {"rid": rid})

    def info_call(self) -> HttpCall:
        return HttpCall("GET", "/v1/models")

    parse_info = VLLMAdapter.parse_info


class _SGLangStream(StreamParser):
    def feed(self, event) -> list[tuple[int, TopK | None]]:
        if "error" in event:
            raise RemoteError(f"SGLang stream error: {event['error']}")
        meta = event.get("meta_info") or {}
        self.cached_tokens = meta.get("cached_tokens", self.cached_tokens)
        self.prompt_tokens = meta.get("prompt_tokens", self.prompt_tokens)
        toks = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        total = meta.get("completion_tokens", self.n + len(toks))
        new = max(0, int(total) - self.n)  # cumulative lists: the last `new`; else all of it
        out = []
        for i in range(len(toks) - new, len(toks)):
            top = tops[i] if i < len(tops) and tops[i] else None
            out.append((int(toks[i][1]), TopK(tuple(int(t[1]) for t in top),
                                              tuple(_lp(t[0]) for t in top)) if top else None))
        if meta.get("finish_reason") is not None:
            self.finished = True
        self.n += len(out)
        return out


class LlamaCppAdapter(Adapter):
    """llama.cpp's `llama-server` `POST /completion`.

    Request: `prompt` a token array, `n_predict: 1`, `n_probs: k`, `cache_prompt: true`,
    `temperature: 0` (greedy; the probabilities are then a plain softmax of the logits,
    before any sampler), `id_slot` for slot affinity (each slot keeps its own prompt cache),
    `post_sampling_probs: false`. Response: `completion_probabilities[0]`, whose shape depends
    on the server version: `top_logprobs: [{id, token, logprob}]` (current), `top_probs:
    [{id, token, prob}]` (with `post_sampling_probs`), or `probs: [{tok_str, prob}]` (before
    late 2024: no ids, so a `token_to_id` map is needed). Cached prompt tokens: `timings.cache_n`
    where reported, else `tokens_cached`; `id_slot` says which slot served it. Slots and
    context: `GET /props` `total_slots` and `default_generation_settings.n_ctx` (per slot).
    There is no abort endpoint: the server cancels a task when its client disconnects.

    Streamed answers: `stream: true`, `n_predict`, `n_probs`, `seed` (-1 when none), the
    sampler chain given explicitly as prepos applies it (`samplers: top_k, temperature,
    top_p`; llama.cpp's default chain runs top-p before temperature, and adds min-p 0.05
    and top-k 40) with `min_p: 0`, `repeat_penalty: 1`, and `top_k: 1` at temperature 0 (the
    same choice, without the rest of the chain working on the whole vocabulary). Each
    event carries one token (`tokens: [id]`, `completion_probabilities[0]`, raw logprobs)
    and the running count `tokens_predicted`; the final event (`stop: true`) the timings.
    llama-server has no stop token ids: it stops on the model's end-of-generation tokens,
    and prepos closes the stream (the server then aborts the task) after any other token
    in the stop set. A token whose text is an incomplete UTF-8 sequence is never streamed
    (the count shows the gap): that raises, since the token ids would be wrong; serve a
    GGUF exported with `prepos.backends.gguf_export.export(for_token_ids=True)`.
    """

    kind = "llama.cpp"
    health_path = "/health"
    uses_slots = True
    stops_on_ids = False

    def __init__(self, model: str | None = None, background_priority: int | None = None,
                 token_to_id: Callable[[str], int | None] | None = None):
        super().__init__(model, background_priority)
        self.token_to_id = token_to_id

    def request(self, prompt, k, *, rid, background, slot=None) -> HttpCall:
        body: dict = {"prompt": list(prompt), "n_predict": 1, "n_probs": k,
                      "cache_prompt": True, "temperature": 0.0, "post_sampling_probs": False,
                      "stream": False}
        if slot is not None:
            body["id_slot"] = slot
        return HttpCall("POST", "/completion", body)

    def parse(self, body) -> TopK:
        try:
            first = body["completion_probabilities"][0]
        except (KeyError, IndexError, TypeError) as exc:
            if isinstance(body, dict) and body.get("tokens_predicted") == 1:
                # llama-server withholds a token whose text is an incomplete UTF-8 sequence,
                # and its probabilities with it
                raise RemoteError(
                    "llama-server returned no probabilities: the greedy token's text is an "
                    "incomplete UTF-8 sequence; serve a GGUF exported with "
                    "prepos.backends.gguf_export.export(for_token_ids=True)") from exc
            raise RemoteError("llama.cpp response has no completion_probabilities "
                              f"(is n_probs > 0?): {exc!r}") from exc
        ids, lps = self.probs(first)
        timings = body.get("timings") or {}
        cached = timings.get("cache_n", body.get("tokens_cached"))
        prompt_n = body.get("tokens_evaluated")
        return TopK(ids, lps, cached, prompt_n, body.get("id_slot"))

    def probs(self, first: dict) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """One token's top-k from a `completion_probabilities` entry (any server version)."""
        if "top_logprobs" in first:
            ids = [int(t["id"]) for t in first["top_logprobs"]]
            lps = [_lp(t["logprob"]) for t in first["top_logprobs"]]
            if "id" in first and "logprob" in first and int(first["id"]) not in ids:
                ids.append(int(first["id"]))  # a sampled token outside the top-k
                lps.append(_lp(first["logprob"]))
            return tuple(ids), tuple(lps)
        if "top_probs" in first:
            return (tuple(int(t["id"]) for t in first["top_probs"]),
                    tuple(_log(t["prob"]) for t in first["top_probs"]))
        if "probs" in first:  # older servers: probabilities keyed by token text
            ids_l, lps_l = [], []
            for t in first["probs"]:
                tid = t.get("id")
                if tid is None:
                    tid = self.token_to_id(t["tok_str"]) if self.token_to_id else None
                if tid is None:
                    raise RemoteError("llama.cpp returned probabilities by token text only; "
                                      "pass token_to_id to map them")
                ids_l.append(int(tid))
                lps_l.append(_log(t["prob"]))
            return tuple(ids_l), tuple(lps_l)
        raise RemoteError(f"unknown llama.cpp probability format: {sorted(first)}")

    def stream_request(self, prompt, k, sampling, max_tokens, stop_ids, *, rid, background,
                       slot=None) -> HttpCall:
        seed = _seed(sampling)
        body: dict = {"prompt": list(prompt), "n_predict": int(max_tokens), "n_probs": k,
                      "cache_prompt": True, "stream": True, "post_sampling_probs": False,
                      "temperature": float(sampling.temperature),
                      # at temperature 0 the chain keeps the top token whatever top_k is:
                      # top_k 1 keeps it first, sparing the rest of the chain (and the draw
                      # that ends it) the whole vocabulary each token
                      "top_k": 1 if sampling.temperature <= 0 else int(sampling.top_k),
                      "top_p": float(sampling.top_p),
                      "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
                      "presence_penalty": 0.0, "frequency_penalty": 0.0,
                      "samplers": ["top_k", "temperature", "top_p"],
                      "seed": -1 if seed is None else int(seed)}
        if slot is not None:
            body["id_slot"] = slot
        return HttpCall("POST", "/completion", body)

    def stream_parser(self) -> StreamParser:
        return _LlamaCppStream(self)

    def info_call(self) -> HttpCall:
        return HttpCall("GET", "/props")

    def parse_info(self, body) -> EngineInfo:
        body = body or {}
        ctx = (body.get("default_generation_settings") or {}).get("n_ctx") or body.get("n_ctx")
        return EngineInfo(max_context=int(ctx) if ctx else None,
                          n_slots=max(1, int(body.get("total_slots", 1))))

    def parse_slots(self, body) -> int:
        return self.parse_info(body).n_slots or 1


class _LlamaCppStream(StreamParser):
    def __init__(self, adapter: LlamaCppAdapter):
        super().__init__()
        self.adapter = adapter

    def feed(self, event) -> list[tuple[int, TopK | None]]:
        if "error" in event:
            raise RemoteError(f"llama-server stream error: {event['error']}")
        if event.get("id_slot") is not None:
            self.slot = event["id_slot"]
        out: list[tuple[int, TopK | None]] = []
        probs = event.get("completion_probabilities") or []
        for i, tok in enumerate(event.get("tokens") or []):
            top = TopK(*self.adapter.probs(probs[i])) if i < len(probs) else None
            out.append((int(tok), top))
        predicted = event.get("tokens_predicted")
        if out and predicted is not None and predicted > self.n + len(out):
            raise RemoteError(
                "llama-server withheld a streamed token (its text is an incomplete UTF-8 "
                "sequence), so the token ids are incomplete; serve a GGUF exported with "
                "prepos.backends.gguf_export.export(for_token_ids=True)")
        if event.get("stop"):
            self.finished = True
            timings = event.get("timings") or {}
            self.cached_tokens = timings.get("cache_n", event.get("tokens_cached"))
            self.prompt_tokens = event.get("tokens_evaluated")
        self.n += len(out)
        return out


ADAPTERS: dict[str, type[Adapter]] = {
    "vllm": VLLMAdapter, "sglang": SGLangAdapter, "llama.cpp": LlamaCppAdapter,
    "llamacpp": LlamaCppAdapter, "llama-server": LlamaCppAdapter,
}


def make_adapter(kind: str, **kwargs) -> Adapter:
    try:
        cls = ADAPTERS[kind]
    except KeyError:
        raise ValueError(f"unknown engine kind {kind!r}; one of {sorted(ADAPTERS)}") from None
    return cls(**kwargs)
