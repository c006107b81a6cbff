"""The durable room: what outlives a process or a node. The journal and the store under it
(SQLite or PostgreSQL), leases and the cluster, forwarding, idempotency keys, stored responses,
conversations and the conversation directory."""
