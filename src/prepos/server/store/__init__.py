"""The store: what outlives a process or a node. The journal and the database under it
(SQLite or PostgreSQL), leases, idempotency records, stored responses, conversations and the
conversation directory."""
