"""What the OpenAI-API tests read of a response and of the session behind it."""

from __future__ import annotations

import openai


def openai_client(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def ext(r) -> dict:
    """The body's `prepos` extension."""
    return r.model_extra["prepos"]


def held(http, sid: str) -> list[dict]:
    """The messages session `sid` holds."""
    r = http.get(f"/sessions/{sid}", params={"include": "messages"})
    r.raise_for_status()
    return r.json()["message_list"]
