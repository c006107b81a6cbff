"""The HTTP server: the session API, OpenAI-compatible endpoints, SSE, metrics, the
journal. `prepos.server.app.create_app(ServerConfig(model=...))` builds the app;
`prepos serve` (`prepos.server.app:main`) runs it."""
