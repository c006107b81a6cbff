"""The prefix index: every KV's token sequence by blocks, resident or held in a lower tier
(host RAM, disk), so a KV about to be filled can start from the longest prefix of its target
that any other KV of the same scope holds (another session's committed state, a
pre-positioned entry, a stateless conversation) and prefill only the rest.

A KV's tokens are cut into blocks of `BLOCK`; block j is known by a chain hash over its
scope and every token up to the block's end, so one lookup per block walks the target from
its start and the deepest hash found names a KV holding the whole prefix up to there (then
compared token by token, so a hash collision costs a lookup, never a wrong prefix). The
scope is the sessions' owner (the API key that made them): a prefix is never shared across
scopes. Owned by the model worker, like the KVs it indexes.
"""

from __future__ import annotations

from typing import Protocol, Sequence

BLOCK = 16  # tokens per indexed block: the least a shared prefix saves (a system line)


class Indexed(Protocol):
    """What the index knows of a KV (`KVSequence`): its scope, tokens and block hashes, and
    its back-end handle (None while its state is in a lower tier)."""

    scope: str | None
    tokens: list[int]
    hashes: list[int]
    handle: object

    def common_prefix(self, target: Sequence[int]) -> int: ...


def chain(scope: str | None, tokens: Sequence[int], start: int, hashes: list[int],
          upto: int) -> list[int]:
    """The chain hashes of blocks `start`..`upto`-1 of `tokens`, after `hashes` (the chain
    hashes of the blocks before `start`)."""
    h = hashes[start - 1] if start else hash(("prefix", scope))
    out = []
    for j in range(start, upto):
        h = hash((h, tuple(tokens[j * BLOCK:(j + 1) * BLOCK])))
        out.append(h)
    return out


class PrefixIndex:
    def __init__(self) -> None:
        self._at: dict[int, dict[Indexed, None]] = {}  # chain hash -> KVs, oldest first
        self.hits = 0  # KVs that started from another's prefix
        self.tokens = 0  # the tokens they did not prefill for it

    def add(self, kv: Indexed, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._at.setdefault(h, {})[kv] = None

    def remove(self, kv: Indexed, hashes: Sequence[int]) -> None:
        for h in hashes:
            holders = self._at.get(h)
            if holders is not None:
                holders.pop(kv, None)
                if not holders:
                    del self._at[h]

    def longest(self, kv: Indexed, target: Sequence[int]) -> tuple[Indexed | None, int]:
        """Another KV of `kv`'s scope holding more of `target`'s prefix than `kv` does, and
        how much of it: the longest such; among equals a resident one (shared where a
        lower tier's must be loaded), then the most recently filled."""
        kept = kv.common_prefix(target)
        own = kept // BLOCK
        others: list[Indexed] = []
        hashes = kv.hashes[:own]
        for h in chain(kv.scope, target, own, hashes, len(target) // BLOCK):
            holders = self._at.get(h)
            deeper = [o for o in holders if o is not kv] if holders else None
            if not deeper:
                break
            others = deeper
        best = next((o for o in reversed(others) if o.handle is not None),
                    others[-1] if others else None)
        if best is None:
            return None, kept
        n = best.common_prefix(target)
        return (best, n) if n > kept else (None, kept)
