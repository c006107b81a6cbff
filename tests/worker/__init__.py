"""The model worker: its scheduler, the KV tiers, the prefix index."""
