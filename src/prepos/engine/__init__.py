"""The serving core's top: the `Engine` facade (`facade.py`) and what it is built of: the
sessions and their ready sets, admission and room, the pre-positioner (Algorithm 1), the
three answer paths, loading a model into an engine, the remote engine.

The names below are the engine's public face: the server and the Python API import these and
nothing from the modules beneath (a test keeps `prepos.server` to them)."""

from prepos.engine.admission import valid_ids
from prepos.engine.facade import Engine, load_engine
from prepos.engine.implicit import EPHEMERAL, conversation_keys, is_ephemeral
from prepos.engine.loading import resolve_model
from prepos.engine.remote import remote_config, remote_engine
from prepos.engine.session import TURN, Session, Snapshot, check_context, query_key
from prepos.engine.session_spec import AGENTIC, STREAMING, SessionSpec

__all__ = ["AGENTIC", "EPHEMERAL", "STREAMING", "TURN", "Engine", "Session", "SessionSpec",
           "Snapshot", "check_context", "conversation_keys", "is_ephemeral", "load_engine",
           "query_key", "remote_config", "remote_engine", "resolve_model", "valid_ids"]
