"""The one adapter over the transformers cache API, which changed between 5.x releases:
the forward keyword (`past_key_values` before, `cache` after) and `Cache.crop`'s argument
(an absolute `max_length` before, a negative `tokens_to_remove` after)."""

from __future__ import annotations

import inspect
import io
from typing import Any

import torch
from transformers import DynamicCache


class CacheAdapter:
    def __init__(self, model: torch.nn.Module):
        params = inspect.signature(model.forward).parameters
        self.kwarg = "cache" if "cache" in params else "past_key_values"
        crop_params = list(inspect.signature(DynamicCache.crop).parameters)
        self.crop_removes = "tokens_to_remove" in crop_params
        self.config = model.config

    def new(self) -> DynamicCache:
        try:
            return DynamicCache(config=self.config)
        except TypeError:  # releases whose DynamicCache takes no config
            return DynamicCache()

    @staticmethod
    def length(cache: DynamicCache) -> int:
        return int(cache.get_seq_length())

    def crop(self, cache: DynamicCache, length: int) -> None:
        """Keep the first `length` positions of every layer. Layers can differ in length
        after an interrupted forward, so each is cropped by its own length."""
        for layer in cache.layers:
            current = int(layer.get_seq_length())
            if length < current:
                # negative: tokens to remove from the end; older releases: the absolute size
                layer.crop(length - current if self.crop_removes else length)

    def copy_prefix(self, src: DynamicCache, dst: DynamicCache, length: int) -> None:
        """`dst` holds the first `length` positions of `src` (copies of its tensors)."""
        self.crop(dst, 0)
        for i, layer in enumerate(src.layers):
            dst.update(layer.keys[..., :length, :].clone(),
                       layer.values[..., :length, :].clone(), i)

    def save(self, cache: DynamicCache) -> bytes:
        """Every layer's keys and values, serialized."""
        out = io.BytesIO()
        torch.save([(layer.keys, layer.values) for layer in cache.layers
                    if getattr(layer, "keys", None) is not None], out)
        return out.getvalue()

    def load(self, data: bytes) -> DynamicCache:
        cache = self.new()
        for i, (keys, values) in enumerate(torch.load(io.BytesIO(data))):
            cache.update(keys, values, i)
        return cache

    def forward_kwargs(self, cache: Any) -> dict:
        return {self.kwarg: cache, "use_cache": True}
