"""The domain task the bundled model is trained on and calibrated against."""

from prepos.lab.task.market import (
    ANSWERS,
    POLAR,
    SYSTEM_PROMPT,
    TICKERS,
    TRENDS,
    DecisionPoint,
    Example,
    Query,
    Stream,
    decision_points,
    format_data,
    generate_stream,
    queries,
    trend_of,
)

__all__ = [
    "ANSWERS",
    "POLAR",
    "SYSTEM_PROMPT",
    "TICKERS",
    "TRENDS",
    "DecisionPoint",
    "Example",
    "Query",
    "Stream",
    "decision_points",
    "format_data",
    "generate_stream",
    "queries",
    "trend_of",
]
