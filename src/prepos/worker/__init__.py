"""The model worker: the scheduler (foreground before idle work, batched steps) and the KV
caches it owns."""
