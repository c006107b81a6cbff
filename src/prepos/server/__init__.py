"""The HTTP server, in three rooms: `http/` (the app, the session API, its guard, limits, keys,
errors, SSE and metrics), `openai/` (the OpenAI-compatible routes: chat, completions,
Responses, Conversations, their checks and bodies) and `durable/` (what outlives a process or
a node: the journal, its store, leases, the cluster, idempotency keys, stored responses and
conversations). `prepos.server.http.app.create_app(ServerConfig(model=...))` builds the app;
`prepos serve` (`prepos.server.http.app:main`) runs it."""
