"""prepos: a stateful-session LLM server that answers before it is asked.

The public face: `Engine` (the facade; `Engine.from_pretrained` or `load_engine` serves a
local model), `Request` and `SamplingParams` (what a request asks), `Stream` (its answer as
produced) and `Result`, the configurations and the error base class. `Engine`, `Stream` and
`load_engine` are imported on first use, so `import prepos` stays light."""

from prepos.config import BudgetConfig, EngineConfig, GateConfig
from prepos.core import AnswerPath, Match, Request, Result, SamplingParams, Timing
from prepos.errors import PreposError

LAZY = {"Engine": "prepos.engine.facade", "load_engine": "prepos.engine.facade",
        "Stream": "prepos.decode.stream"}

__all__ = ["AnswerPath", "BudgetConfig", "Engine", "EngineConfig", "GateConfig", "Match",
           "PreposError", "Request", "Result", "SamplingParams", "Stream", "Timing",
           "load_engine"]


def __getattr__(name: str):
    if name in LAZY:
        import importlib

        return getattr(importlib.import_module(LAZY[name]), name)
    raise AttributeError(f"module 'prepos' has no attribute {name!r}")
