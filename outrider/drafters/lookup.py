"""Prompt lookup in the coordinator: a drafter with no model needs no worker.

Prompt lookup drafts the continuation of the latest earlier occurrence of
the history's last n-gram (prompt lookup decoding, Saxena 2023;
``prompt_lookup_num_tokens`` in transformers): a few dictionary lookups on
the history the coordinator holds anyway (:class:`NgramIndex`). Asked of a
worker it would cost an RPC and that worker's CPU each round, match or not.
Here the round loop looks each session's next draft up as soon as a round
commits, so the plan of K knows, before any session is asked, which have a
draft to offer, how long, and how good: the length n of the matched n-gram
says far more about a draft's acceptance than a session's past rounds do,
and many positions have no match at all
(docs/benchmark.md#prompt-lookup-by-match). So the acceptance is learnt
per n, depth by depth
(:meth:`outrider.coordinator.adaptive.acceptance.Acceptance.survival_of`), and a
round without a match, or whose match the plan of K finds too weak at the
load, costs what a round at K = 0 does.

This module also holds what every drafter in the coordinator is: a
:class:`Lookup` that gives each session a :class:`SessionLookup`, whose
``match`` offers a :class:`Match`. Suffix decoding
(:mod:`outrider.drafters.suffix`) is the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from outrider.config import CoordinatorConfig

DRAFTER = "prompt-lookup"


@dataclass(frozen=True)
class Match:
    """A history's draft and the evidence it rests on (``n``; 0: no
    draft): for prompt lookup, the tokens that followed the latest earlier
    occurrence of its last ``n`` tokens."""

    n: int
    tokens: list[int]


NO_MATCH = Match(0, [])


class Lookup:
    """A drafter in the coordinator: each session's next draft looked up
    after every round from what the coordinator holds (prompt lookup,
    suffix decoding), no draft worker."""

    name = ""

    def index(self, prompt_len: int = 0) -> SessionLookup:
        """What one session's lookups keep as its history (its first
        ``prompt_len`` tokens the prompt) grows."""
        raise NotImplementedError


class SessionLookup(Protocol):
    def match(self, history: Sequence[int], k: int) -> Match:
        """Up to ``k`` tokens to follow ``history``, which extends the
        history of the previous call, and the evidence they rest on."""
        ...

    def ended(self, history: Sequence[int]) -> None:
        """The session ended with ``history``."""


class PromptLookup(Lookup):
    """Drafts by matching the history's last n-gram, the longest n first."""

    name = DRAFTER

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def index(self, prompt_len: int = 0) -> NgramIndex:
        """An index for one session's growing history."""
        return NgramIndex(range(self.max_ngram, self.min_ngram - 1, -1))


class NgramIndex:
    """Where each n-gram of a history last ended, kept up as the history grows.

    A session looks its next draft up after every round, at up to thousands
    of rounds a second in one coordinator; a scan of the whole history each
    time (tens of microseconds at a few hundred tokens, growing with it)
    would make the lookup the coordinator's largest cost. Indexed, a round
    costs a few dictionary operations per n for each committed token, and a
    lookup one per n. A session's history only grows (committed tokens are
    never taken back), which is what lets the index be incremental.
    """

    def __init__(self, ngrams: range) -> None:
        self.ngrams = ngrams
        """The n matched, longest first."""
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in ngrams}
        """By n: each n-gram's latest end that has a token after it."""
        self.length = 0
        """The length of the history last matched: its ends are indexed."""

    def match(self, history: Sequence[int], k: int) -> Match:
        """Up to ``k`` tokens to follow ``history``, which extends the
        history of the previous call, and the n of their match."""
        end = len(history)
        if end < self.length:
            raise ValueError("a prompt lookup index's history only grows")
        for position in range(max(self.length, 1), end):
            for n, ends in self.ends.items():
                if position >= n:
                    ends[tuple(history[position - n : position])] = position
        self.length = end
        for n in self.ngrams:
            start = self.ends[n].get(tuple(history[end - n :])) if end > n else None
            if start is not None:
                return Match(n, list(history[start : start + k]))
        return NO_MATCH

    def ended(self, history: Sequence[int]) -> None:
        """(A session's own history is forgotten with it.)"""


def load(config: CoordinatorConfig) -> PromptLookup:
    """``--prompt-lookup``, matching up to ``--max-ngram`` tokens."""
    return PromptLookup(max_ngram=config.max_ngram)
