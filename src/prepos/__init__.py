"""prepos: a stateful-session LLM server that answers before it is asked."""

from prepos.config import BudgetConfig, EngineConfig, GateConfig
from prepos.core import Path, Result, SamplingParams, Timing
from prepos.errors import PreposError

__all__ = [
    "BudgetConfig",
    "EngineConfig",
    "GateConfig",
    "Path",
    "PreposError",
    "Result",
    "SamplingParams",
    "Timing",
]
