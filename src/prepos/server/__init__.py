"""The HTTP server: `http/` (the app, its front layers, the session API, its guard, limits,
keys, errors, idempotency keys, SSE and metrics), `openai/` (the OpenAI-compatible routes:
chat, completions, Responses, Conversations, their checks and bodies), `anthropic/` (the
Messages API), `store/` (what outlives a process or a node: the journal, the database under
it, leases, idempotency records, stored responses, conversations and the conversation
directory) and `cluster.py` (several nodes on one store: who serves a session).
`prepos.server.http.app.create_app(ServerConfig(model=...))` builds the app; `prepos serve`
(`prepos.server.http.app:main`) runs it."""
