"""A session's committed versions kept for rollback, as messages only and sharing what they
share: each version is the version before it cut to a length and extended by its new
messages (an append is one message), with every `CHECKPOINT`-th version and the oldest kept
whole, so reading one walks at most that many. Rendered text and tokens are not kept: the
session renders an old version when it is rolled back to or read. So a session's versions
cost about a hundred bytes each beyond the messages themselves, not a rendering each.

Not thread-safe: the session's lock guards it.
"""

from __future__ import annotations

from typing import Iterator, Sequence

CHECKPOINT = 64  # a version kept whole at least this often


class History:
    def __init__(self, max_versions: int):
        self.max_versions = max(1, max_versions)
        self._versions: list[int] = []  # oldest first
        self._index: dict[int, int] = {}  # version -> position in _versions + _dropped
        self._dropped = 0  # versions pruned from the front so far
        # per version: (keep, added): the version before it cut to `keep` messages, then
        # `added`; keep 0: `added` is the version whole
        self._deltas: list[tuple[int, tuple[dict, ...]]] = []
        self._last: tuple[dict, ...] = ()  # the newest version's messages
        self._since_whole = 0

    def add(self, version: int, messages: Sequence[dict]) -> None:
        """The newest version; the oldest is forgotten beyond `max_versions`."""
        messages = tuple(messages)
        keep = 0
        if self._versions and self._since_whole < CHECKPOINT:
            prev, n = self._last, min(len(self._last), len(messages))
            if prev[:n] == messages[:n]:  # an append: compared in C, the same objects
                keep = n
            else:
                while prev[keep] is messages[keep] or prev[keep] == messages[keep]:
                    keep += 1
        if keep:
            self._deltas.append((keep, messages[keep:]))
            self._since_whole += 1
        else:
            self._deltas.append((0, messages))
            self._since_whole = 0
        self._index[version] = len(self._versions) + self._dropped
        self._versions.append(version)
        self._last = messages
        while len(self._versions) > self.max_versions:
            self._drop_oldest()

    def messages(self, version: int) -> tuple[dict, ...]:
        """A kept version's messages (KeyError if it is not kept)."""
        i = self._index[version] - self._dropped
        j = i
        while self._deltas[j][0]:  # back to a version kept whole
            j -= 1
        msgs = list(self._deltas[j][1])
        for keep, added in self._deltas[j + 1:i + 1]:
            del msgs[keep:]
            msgs.extend(added)
        return tuple(msgs)

    def all(self) -> dict[int, tuple[dict, ...]]:
        """Every kept version's messages, oldest first."""
        out, msgs = {}, []
        for version, (keep, added) in zip(self._versions, self._deltas):
            del msgs[keep:]
            msgs.extend(added)
            out[version] = tuple(msgs)
        return out

    def _drop_oldest(self) -> None:
        if len(self._versions) > 1 and self._deltas[1][0]:  # the next oldest, kept whole
            self._deltas[1] = (0, self.messages(self._versions[1]))
            if len(self._versions) == 2:
                self._since_whole = 0
        del self._index[self._versions.pop(0)]
        self._deltas.pop(0)
        self._dropped += 1

    def __contains__(self, version: object) -> bool:
        return version in self._index

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._versions))

    def __len__(self) -> int:
        return len(self._versions)
