"""Prompt lookup in the coordinator: a drafter with no model needs no worker.

Prompt lookup drafts the continuation of the latest earlier occurrence of
the history's last n-gram (prompt lookup decoding, Saxena 2023;
``prompt_lookup_num_tokens`` in transformers): microseconds of numpy on the
history the coordinator holds anyway. Asked of a worker it would cost an RPC
and that worker's CPU each round, match or not. Here the round loop looks
each session's next draft up as soon as a round commits, so the plan of K
knows, before any session is asked, which have a draft to offer, how long,
and how good: the length n of the matched n-gram says far more about a
draft's acceptance than a session's past rounds do, and many positions have
no match at all (docs/benchmark.md#prompt-lookup-by-match). So the
acceptance is learnt per n (:meth:`coordinator.costs.CostModel.alpha_of`),
and a round without a match, or whose match the plan of K finds too weak
at the load, costs what a round at K = 0 does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.workers import WorkerInfo

DRAFTER = "prompt-lookup"


@dataclass(frozen=True)
class Match:
    """A history's draft: the tokens that followed the latest earlier
    occurrence of its last ``n`` tokens (n = 0, none: no match)."""

    n: int
    tokens: list[int]


NO_MATCH = Match(0, [])


class PromptLookup:
    """Drafts by matching the history's last n-gram, the longest n first."""

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    @property
    def info(self) -> WorkerInfo:
        """The drafter as a worker would describe itself: any vocabulary, any context."""
        return WorkerInfo(
            model=DRAFTER, drafter=DRAFTER, vocab_size=0, vocab_fingerprint="", max_context=0
        )

    def match(self, tokens: Sequence[int], k: int) -> Match:
        """Up to ``k`` tokens to follow ``tokens``, and the n of their match."""
        history = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            # Earlier windows equal to the last n tokens; the latest one wins.
            windows = np.lib.stride_tricks.sliding_window_view(history[:-1], n)
            matches = np.flatnonzero((windows == history[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return Match(n, history[start : start + k].tolist())
        return NO_MATCH
