"""Question classes for the relaxed fast path: a question's normalized form (data-dependent
spans masked), or the first of a session's declared wordings it matches."""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass
from typing import Sequence

from prepos.errors import InvalidInput

NUM, SYM, STR = "<num>", "<sym>", "<str>"
MAX_CLASS_CHARS = 512  # a longer normalized question has no class (never served relaxed)
MAX_PATTERNS = 64
_QUOTED = re.compile(r"\"[^\"]*\"|“[^”]*”|‘[^’]*’|`[^`]*`|(?<!\w)'[^'\n]+'(?!\w)")
_CASHTAG = re.compile(r"\$[A-Za-z][A-Za-z0-9.]{0,9}\b")
_NUMBER = re.compile(r"[-+]?[$€£¥]?\d[\d,_]*(?:[.:/-]\d+)*(?:[eE][-+]?\d+)?%?")
_TICKER = re.compile(r"\b[A-Z][A-Z0-9]{1,5}(?:[.:][A-Z0-9]{1,4})?\b")
_RUN = re.compile(r"(<num>|<sym>|<str>)(?:[\s,]+\1)+")
_SPACE = re.compile(r"\s+")
_BEFORE_PUNCT = re.compile(r"\s+([,.:;?!)\]])")
_TRAIL = re.compile(r"[\s?!.]+$")


def masked_wording(question: str, wildcards: bool = False) -> str:
    """A question's class: NFKC, then quoted strings -> <str>, cashtags and tickers (an
    all-capitals word of 2-6 letters or digits, in a question that has lower case) -> <sym>,
    numbers (signs, currency, separators, decimals, dates, times, percentages) -> <num>;
    a run of one mask ("41 43 44") -> one; lower case, whitespace collapsed, trailing
    punctuation dropped. `*` is dropped from questions and kept, as a wildcard, in patterns."""
    text = unicodedata.normalize("NFKC", question)
    text = _QUOTED.sub(f" {STR} ", text)
    text = _CASHTAG.sub(f" {SYM} ", text)
    if any(c.islower() for c in text.replace(STR, "").replace(SYM, "")):
        text = _TICKER.sub(f" {SYM} ", text)
    text = _NUMBER.sub(f" {NUM} ", text)
    text = text.lower()
    if not wildcards:
        text = text.replace("*", " ")
    text = _SPACE.sub(" ", text).strip()
    text = _BEFORE_PUNCT.sub(r"\1", _RUN.sub(r"\1", text))
    return _TRAIL.sub("", text)


@dataclass(frozen=True)
class Pattern:
    """A declared wording: its class key (the normalized wording) and what it matches (the
    normalized question, `*` standing for one or more characters)."""

    key: str
    parts: tuple[str, ...]  # the literal text around each `*`, stripped

    def matches(self, cls: str) -> bool:
        """A scan, no regex (whose backtracking over several wildcards is exponential): the
        first part a prefix, each middle part found leftmost after at least one character,
        the last a suffix after at least one more."""
        if len(self.parts) == 1:  # no wildcard
            return cls == self.parts[0]
        first, *middle, last = self.parts
        if not cls.startswith(first):
            return False
        at = len(first)
        for part in middle:
            found = cls.find(part, at + 1)
            if found < 0:
                return False
            at = found + len(part)
        return cls.endswith(last) and len(cls) - len(last) >= at + 1


@functools.lru_cache(maxsize=1024)
def patterns(wordings: tuple[str, ...], owner: str | None = None) -> tuple[Pattern, ...]:
    """The compiled `relaxed_queries` of a session (cached by their text and owner)."""
    out = []
    for w in wordings:
        key = masked_wording(w, wildcards=True)
        out.append(Pattern(key, tuple(p.strip() for p in key.split("*"))))
    return tuple(out)


def check_options(relaxed_queries: Sequence[str], r_max: float | None) -> None:
    """A session's relaxed options, refused (InvalidInput) before anything is created."""
    if len(relaxed_queries) > MAX_PATTERNS:
        raise InvalidInput(f"relaxed_queries takes at most {MAX_PATTERNS} wordings, got "
                           f"{len(relaxed_queries)}")
    for w in relaxed_queries:
        if not isinstance(w, str) or not w.strip():
            raise InvalidInput("relaxed_queries must be non-empty strings")
        key = masked_wording(w, wildcards=True)
        if not key.replace("*", "").strip() or len(key) > MAX_CLASS_CHARS:
            raise InvalidInput(f"relaxed_queries entry {w!r} must have words beside '*' and "
                               f"normalize to at most {MAX_CLASS_CHARS} characters")
    if r_max is not None and (isinstance(r_max, bool) or not isinstance(r_max, (int, float))
                              or not 0.0 < r_max < 1.0):
        raise InvalidInput(f"r_max must be a number in (0, 1), got {r_max!r}")


def classify(question: str, declared: Sequence[str] = (), owner: str | None = None
             ) -> str | None:
    """The question's class key; None when it has none (too long, or matching none of the
    declared wordings of a session that declares some): it is never served relaxed. A
    question `owner` (an API key's id) asked before is a lookup (the relaxed fast path asks
    this on every answer): the cache is keyed by owner too, so a lookup is quicker only for
    the owner's own questions, never for another key's."""
    if len(question) > 4 * MAX_CLASS_CHARS:  # never cached: it could hold long keys
        return _classify(question, tuple(declared), owner)
    return _classify_cached(question, tuple(declared), owner)


def _classify(question: str, declared: tuple[str, ...], owner: str | None = None
              ) -> str | None:  # owner: the caches' key only
    cls = masked_wording(question)
    if not cls or len(cls) > MAX_CLASS_CHARS:
        return None
    if not declared:
        return cls
    return next((p.key for p in patterns(declared, owner) if p.matches(cls)), None)


_classify_cached = functools.lru_cache(maxsize=4096)(_classify)
