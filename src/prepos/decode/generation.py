"""Assembling a request's output token by token: incremental detokenization, stop
sequences, end of turn, max tokens, and the first-token time."""

from __future__ import annotations

import time
from typing import Callable

import torch

from prepos.backends.base import Dist
from prepos.chat.detokenize import Detokenizer
from prepos.chat.format import ChatFormat
from prepos.core import Result, SamplingParams
from prepos.decode.sampling import grammar_finished, token_logprob, top_logprobs
from prepos.decode.stream import Stream, TokenEvent


class Generation:
    def __init__(self, fmt: ChatFormat, sampling: SamplingParams, stream: Stream,
                 result: Result, t0: float, want_logprobs: bool = False,
                 on_finish: Callable[[Result], None] | None = None, sampler=None):
        self.fmt = fmt
        self.sampler = sampler  # the request's sampling state: its grammar, complete, ends it
        self.sampling = sampling
        self.stream = stream
        self.result = result
        self.t0 = t0
        self.want_logprobs = want_logprobs
        # the answer keeps logprobs: each token needs its step's distribution
        self.wants_dists = want_logprobs or bool(sampling.top_logprobs)
        # each step's greedy choice is all it needs (`Forward.greedy`)
        self.greedy = sampling.greedy and not self.wants_dists
        self.on_finish = on_finish
        self.tokens: list[int] = result.tokens
        self._detok = Detokenizer(fmt, self.tokens)  # their text, a token at a time
        self._text = ""
        self._emitted = 0
        self._hold = max(map(len, sampling.stop), default=1) - 1

    def add(self, token: int, logits: torch.Tensor | Dist | None = None,
            logprob: float | None = None) -> bool:
        """Take the next token; returns True when the generation is finished."""
        if self.stream.cancelled:  # nobody reads on: drop the token, stop decoding
            return self.finish("cancelled")
        if not self.tokens and self.result.timing.ttft == 0.0:
            self.result.timing.ttft = time.perf_counter() - self.t0
        if token in self.fmt.end_of_turn:
            return self.finish("stop")
        if logprob is None and self.want_logprobs and logits is not None:
            logprob = token_logprob(logits, token)
        self.tokens.append(token)
        if logprob is not None:
            self.result.logprobs.append(logprob)
        top = None
        if self.sampling.top_logprobs and logits is not None:
            top = top_logprobs(logits, self.sampling.top_logprobs)
            self.result.top_logprobs.append(top)
        detok = self._detok
        detok.add()
        text = detok.text
        stop_at = self._stop(text, detok.fixed)
        if stop_at >= 0:
            self._text = text[:stop_at]
            return self.finish("stop", token, logprob, top, cut=True)
        self._text = text
        if grammar_finished(self.sampler):
            return self.finish("stop", token, logprob, top)
        safe = len(text) - self._hold
        if text.endswith("\ufffd"):  # an incomplete character: wait for its next byte
            safe = min(safe, len(text) - 1)
        self._emit(token, safe, logprob, top)
        if len(self.tokens) >= self.sampling.max_tokens:
            return self.finish("length")
        return False

    def _stop(self, text: str, fixed: int) -> int:
        """Where the first stop string starts in `text`, or -1; none was in its first `fixed`
        characters (they were searched at an earlier token), so the search starts where one
        could end after them."""
        if not self.sampling.stop:
            return -1
        found = [text.find(s, max(0, fixed - len(s) + 1)) for s in self.sampling.stop]
        return min((i for i in found if i >= 0), default=-1)

    def _emit(self, token: int, upto: int, logprob: float | None, top) -> None:
        delta = self._text[self._emitted:upto] if upto > self._emitted else ""
        self._emitted = max(self._emitted, upto)
        self.stream.push(TokenEvent(token, delta, logprob, top))

    def finish(self, reason: str, token: int | None = None, logprob: float | None = None,
               top: list[tuple[int, float]] | None = None, cut: bool = False) -> bool:
        """End the answer (`cut`: at a stop string, its text already cut there)."""
        if not cut and self._detok.pending:  # an incomplete character ends it: shown as
            self._text = self._detok.whole()  # decoding the tokens whole shows it
        rest = self._text[self._emitted:]
        if rest or token is not None:
            self.stream.push(TokenEvent(token if token is not None else -1, rest, logprob,
                                        top))
            self._emitted = len(self._text)
        res = self.result
        res.text = self._text
        res.finish_reason = reason
        res.timing.total = time.perf_counter() - self.t0
        if self.on_finish is not None:
            self.on_finish(res)
        self.stream.finish(res)
        return True
