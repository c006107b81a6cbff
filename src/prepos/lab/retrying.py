"""The project's clients' one retry rule: a request that met a dying node is sent again.

`send(headers)` makes one attempt and returns `(status, headers, body)` (header names lower
case), or raises `OSError` / `http.client.HTTPException` (the connection refused or broken).
A 502, 503 or 504, a 409 `session_moved` (the session moved under the request), or a broken
connection is tried again, with backoff (doubling
from `first_s` up to `most_s`, jittered, at least the answer's `Retry-After`), until
`deadline_s` has passed; then the last answer is returned (or the error raised). Every attempt
carries the same `Idempotency-Key`, so a retry of a mutation that did commit is answered its
first result and commits nothing.
"""

from __future__ import annotations

import http.client
import random
import time
import uuid
from collections.abc import Callable

RETRIED = (502, 503, 504)
Answer = tuple[int, dict[str, str], bytes]


def new_key() -> str:
    return uuid.uuid4().hex


def retrying(send: Callable[[dict[str, str]], Answer], key: str | None = None, *,
             deadline_s: float = 30.0, first_s: float = 0.1, most_s: float = 2.0,
             on_retry: Callable[[str], None] | None = None) -> Answer:
    """`send`'s answer, tried again on a node's failure (above) with one key throughout."""
    headers = {"Idempotency-Key": key or new_key()}
    end = time.monotonic() + deadline_s
    wait = first_s
    while True:
        try:
            status, head, body = send(headers)
            if not (status in RETRIED or status == 409 and b'"session_moved"' in body):
                return status, head, body
            why, after = f"HTTP {status}", _seconds(head.get("retry-after"))
        except (OSError, http.client.HTTPException) as exc:
            if time.monotonic() >= end:
                raise
            why, after, status = repr(exc), 0.0, None
        pause = max(after, wait * random.uniform(0.5, 1.0))
        if time.monotonic() + pause >= end:
            if status is None:
                raise ConnectionError(f"no answer within {deadline_s} s ({why})")
            return status, head, body
        if on_retry is not None:
            on_retry(why)
        time.sleep(pause)
        wait = min(wait * 2, most_s)


def _seconds(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value is not None else 0.0
    except ValueError:
        return 0.0
