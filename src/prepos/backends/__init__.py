"""Back ends execute forwards on a session's KV; see base.py for the protocol."""
