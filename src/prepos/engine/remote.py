"""An `Engine` on the remote back end (`prepos.backends.remote`): the session layer in front
of vLLM, SGLang or llama.cpp replicas. Apart from the back end so that it imports the engine
and the back end does not."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from prepos.backends.remote import RemoteBackend
from prepos.chat.format import ChatFormat
from prepos.config import EngineConfig
from prepos.engine.facade import Engine
from prepos.engine.loading import load_tokenizer, resolve_model, with_gate

# Pre-positions run at this priority on engines that schedule by priority (lower runs
# earlier; answers are sent at the default, 0). An engine that refuses it is sent none.
BACKGROUND_PRIORITY = 10


def remote_engine(kind: str, urls: Sequence[str] | str, tokenizer_dir: str | Path,
                  config: EngineConfig | None = None, max_context: int | None = None,
                  **kwargs) -> Engine:
    """An `Engine` on a remote back end, with the chat template and tokenizer of a local
    model (an HF directory, a .gguf file or a known name: the same model the engine serves;
    only its tokenizer is read, plus `gate.json` beside it for a calibrated gate). The
    context length is the engine's own (`max_context`, if given, caps it). `kwargs` go to
    `RemoteBackend.from_urls`."""
    path = resolve_model(tokenizer_dir)
    gguf = path.suffix == ".gguf"
    tok = load_tokenizer(path)
    vocab = len(tok)
    if (path / "config.json").is_file():
        vocab = max(vocab, int(json.loads((path / "config.json").read_text())
                               .get("vocab_size", 0)))
    config = with_gate(config or remote_config(), path.parent if gguf else path)
    if kind in ("vllm", "sglang"):
        kwargs.setdefault("background_priority", BACKGROUND_PRIORITY)
    backend = RemoteBackend.from_urls(kind, urls, vocab, max_context, **kwargs)
    return Engine(backend, ChatFormat(tok), config, model_name=path.stem if gguf else path.name)


def remote_config(config: EngineConfig | None = None) -> EngineConfig:
    """`config` (default: the defaults) set for a remote back end: several model workers,
    whose steps wait on the network, not on local cores, and bigger idle chunks, each one
    request to the engine."""
    return replace(config or EngineConfig(), workers=4, idle_workers=2, chunk_tokens=64)
