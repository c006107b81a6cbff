"""The server: the session API, HTTP parts, limits, errors, the store and journal, idempotency,
tenants, /openapi.json."""
