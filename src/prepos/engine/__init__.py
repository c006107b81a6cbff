"""The serving core's top: the `Engine` facade (`facade.py`) and what it is built of: the
sessions and their ready sets, admission and room, the pre-positioner (Algorithm 1), the
three answer paths, loading a model into an engine, the remote engine."""

from prepos.engine.facade import Engine, load_engine

__all__ = ["Engine", "load_engine"]
