"""Several nodes on one PostgreSQL store behind a router."""
