"""In-process back end: a Hugging Face causal LM run through PyTorch, on CPU or CUDA."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AutoModelForCausalLM

from prepos.backends.base import Backend, Preempted, check_preempt
from prepos.backends.hf_cache import CacheAdapter

log = logging.getLogger("prepos.backends.torch")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TorchBackend(Backend):
    name = "torch"
    full_distribution = True
    verifies_drafts = True  # the model returns the logits at every position it ran
    shares_prefixes = True  # a prefix's keys and values copied from another session's cache
    holds_tiers = True  # a cache's tensors saved as bytes and loaded into a new one

    def __init__(self, model: torch.nn.Module, device: str = "cpu"):
        self.model = model.eval()
        self.device = torch.device(device)
        self.cache = CacheAdapter(model)
        # idle forwards stop between decoder layers when a request is waiting (Preempted)
        for layer in _decoder_layers(model):
            layer.register_forward_pre_hook(check_preempt)
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 2048))

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: str = "float32"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available")
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=DTYPES[dtype], local_files_only=True
        ).to(device)
        return cls(model, device)

    def new_kv(self, key: str | None = None) -> Any:
        return self.cache.new()

    @torch.inference_mode()
    def extend(self, kv: Any, past: Sequence[int], tokens: Sequence[int],
               all_logits: bool = False) -> torch.Tensor:
        """The last position's logits, or with `all_logits` every new position's
        ([len(tokens), vocab])."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        keep = 0 if all_logits else 1  # 0: every position
        try:
            out = self.model(input_ids=ids, logits_to_keep=keep, **self.cache.forward_kwargs(kv))
        except Preempted:  # the layers that ran appended the chunk: take it back out
            self.cache.crop(kv, len(past))
            raise
        return out.logits[0].float().cpu() if all_logits else out.logits[0, -1].float().cpu()

    def crop(self, kv: Any, length: int) -> None:
        self.cache.crop(kv, length)

    def copy_prefix(self, src: Any, dst: Any, length: int) -> None:
        self.cache.copy_prefix(src, dst, length)

    def save(self, kv: Any) -> bytes:
        return self.cache.save(kv)

    def load(self, data: bytes, key: str | None = None) -> Any:
        try:
            return self.cache.load(data)
        except Exception as exc:  # not a state `save` wrote (a damaged file): recomputed
            log.warning("a KV state did not load: %s", exc)
            return None


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | tuple:
    """The stack of decoder layers (`model.layers`, `transformer.h`, ...): the module list as
    long as the config's layer count."""
    n = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    return ()
