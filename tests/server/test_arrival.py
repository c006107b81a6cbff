"""Through the app, every route the server counts as arriving (`server/http/arrival.py`)
ends the request's arrival, so no later step waits for it (the scheduler's side:
tests/worker/test_arrivals.py)."""

from __future__ import annotations

from tests.support.helpers import loaded_app


def test_every_counted_route_ends_its_arrival(model_dirs):
    """Through the app: chat (streamed and not, stateless, on a session, refused), Responses
    and Messages each end the request's arrival, so no later step waits for it."""

    from prepos.config import EngineConfig
    from prepos.server.http.app import create_app
    from prepos.server.http.state import ServerConfig

    app = create_app(ServerConfig(model=model_dirs["chatml"], engine=EngineConfig(
        backend="torch", threads=2, batch_wait_ms=600_000)))
    with loaded_app(app) as c:
        eng = app.state.prepos.loaded
        msgs = [{"role": "user", "content": "hi"}]
        model = c.get("/v1/models").json()["data"][0]["id"]
        sid = c.post("/sessions", json={"kind": "agentic"}).json()["id"]
        calls = [("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}, {}),
                 ("/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "stream": True},
                  {}),
                 ("/v1/chat/completions", {"messages": msgs, "max_tokens": 2},
                  {"x-session-id": sid}),
                 ("/v1/chat/completions", {"messages": [], "max_tokens": 2}, {}),
                 ("/v1/responses", {"input": "hi", "max_output_tokens": 2}, {}),
                 ("/v1/messages", {"messages": msgs, "max_tokens": 2, "model": model}, {})]
        for path, body, headers in calls:
            status = c.post(path, json=body, headers=headers).status_code
            assert status in (200, 400), (path, status)
            assert eng.scheduler._arriving == 0, path
