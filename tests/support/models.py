"""The tiny models' families and the in-process back ends the tests run on (the fixtures
on them are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from prepos.backends import llama_cpp

FAMILIES = [("chatml", "llama"), ("llama3", "qwen2")]
# every in-process back end, llama.cpp in both its cache layouts ("/streams": a stream of
# 16384 / 16 = 1024 cells per session)
BACKENDS = ["torch", "llama.cpp", "llama.cpp/streams"]
STREAMS = {"kv_layout": "streams", "max_sequences": 16, "kv_cells": 16384}
NO_LLAMA_CPP = (f"LOUD SKIP: the llama.cpp back end is not installed ({llama_cpp.IMPORT_ERROR}); "
                "run scripts/build_llama_cpp_python.sh")


def backend_config(param: str) -> dict:
    """The EngineConfig fields of one of BACKENDS (skipping where llama.cpp is missing)."""
    name, _, layout = param.partition("/")
    if name == "llama.cpp" and not llama_cpp.available():
        pytest.skip(NO_LLAMA_CPP)
    return {"backend": name, **(STREAMS if layout else {})}
