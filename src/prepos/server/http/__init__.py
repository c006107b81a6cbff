"""The HTTP room: the app and `prepos serve`, the session API and the fast route, the
protocol guard, limits, keys, errors, SSE, metrics and the console."""
