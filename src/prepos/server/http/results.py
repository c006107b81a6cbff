"""A finished request (`Result`) as JSON and as response headers: the path that served it
and its timing go in both, for the session API and the OpenAI-compatible endpoints."""

from __future__ import annotations

import orjson
from starlette.responses import Response

from prepos.core import Result
from prepos.server.http.metrics import cached_prompt_tokens
from prepos.server.names import public

JSON = "application/json"


def json_bytes(data) -> bytes:
    """JSON as every body and event is encoded: orjson, a float that is not finite as null
    (JSON has no such number)."""
    return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)


class JSONBody(Response):
    """A JSON response (`json_bytes`), the headers made at once as the ASGI message carries
    them."""

    media_type = JSON

    def __init__(self, data, status: int = 200, headers: dict[str, str] | None = None):
        self.status_code = status
        self.background = None
        self.body = body = json_bytes(data)
        raw = [(b"content-length", str(len(body)).encode()),
               (b"content-type", b"application/json")]
        if headers:
            raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.raw_headers = raw



def timing(res: Result) -> dict:
    t = res.timing
    return {"queue_ms": t.queue * 1e3, "restore_ms": t.restore * 1e3,
            "prefill_ms": t.prefill * 1e3, "ttft_ms": t.ttft * 1e3, "total_ms": t.total * 1e3,
            "prefill_tokens": t.prefill_tokens, "cached_tokens": t.cached_tokens}


def extension(res: Result, session_id: str | None = None) -> dict:
    """The `prepos` field of a response body: path, match, gate gap, version, timing, and
    the answer's tokens served pre-decoded."""
    return {"path": res.path.value, "match": res.match.value, "gap": res.gap,
            "version": res.version,
            "session_id": None if session_id is None else public(session_id), "timing": timing(res),
            "predecoded": res.predecoded,
            **({"answer_id": res.answer_id} if res.answer_id else {})}


# every header `headers` may set: what browsers (CORS) are allowed to read
EXPOSED = ("X-Prepos-Path", "X-Prepos-Match", "X-Prepos-Version", "X-Prepos-Session",
           "X-Prepos-Answer-Id", "Server-Timing", "Idempotent-Replayed")


def headers(res: Result, session_id: str | None = None) -> dict[str, str]:
    t = res.timing
    h = {"X-Prepos-Path": res.path.value, "X-Prepos-Match": res.match.value,
         "X-Prepos-Version": str(res.version),
         "Server-Timing": (f"queue;dur={t.queue * 1e3:.3f}, restore;dur={t.restore * 1e3:.3f}, "
                           f"prefill;dur={t.prefill * 1e3:.3f}, ttft;dur={t.ttft * 1e3:.3f}, "
                           f"total;dur={t.total * 1e3:.3f}")}
    if session_id is not None:
        h["X-Prepos-Session"] = public(session_id)
    if res.answer_id is not None:  # a relaxed answer: a correction event would name it
        h["X-Prepos-Answer-Id"] = res.answer_id
    return h


def pending_headers(session_id: str | None = None) -> dict[str, str]:
    """Headers of a streamed response whose path is decided on the model worker after they
    are sent: the path comes in the stream's last event instead."""
    h = {"X-Prepos-Path": "pending"}
    if session_id is not None:
        h["X-Prepos-Session"] = public(session_id)
    return h


def session_result(res: Result, session_id: str, logprobs: bool = False,
                   agentic: bool = False, content: str | None = None) -> dict:
    out = {"session_id": public(session_id), "text": res.text, "tokens": res.tokens,
           "finish_reason": res.finish_reason, "path": res.path.value,
           "match": res.match.value, "gap": res.gap, "version": res.version,
           "answer_id": res.answer_id, "timing": timing(res), "predecoded": res.predecoded,
           "usage": {"prompt_tokens": res.prompt_tokens, "completion_tokens": len(res.tokens),
                     "cached_prompt_tokens": cached_prompt_tokens(res)}}
    if logprobs:
        out["logprobs"] = res.logprobs
    if res.top_logprobs:  # [[token id, logprob], ...] per generated token
        out["top_logprobs"] = res.top_logprobs
    if agentic:
        out["content"] = res.text if content is None else content
        out["tool_calls"] = res.tool_calls
        # the answer commits on top of the version it was computed from (or the turn fails
        # with a conflict), so it is the next version
        out["committed_version"] = res.version + 1
    return out
