"""Concurrent streams: who sends what, what one request measured, a batch of them (pure)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import TypedDict, Unpack

from outrider.bench.measurements import median_run
from outrider.bench.prompts import Prompt


def batch_requests(prompts: Sequence[Prompt], concurrency: int) -> list[Prompt]:
    """The requests of a batch at concurrency N: max(N, P) of them, request j asking prompt j mod P.

    N streams take them in order from one queue, each its next as soon as its previous has ended.
    """
    return [prompts[j % len(prompts)] for j in range(max(concurrency, len(prompts)))]


def closed_loop_send_times(
    created_s: Sequence[float], ended_s: Sequence[float], concurrency: int
) -> list[float]:
    """When N closed-loop streams would have sent each of a queue's requests: the first N at once
    (their creation), each later one when a request before it ended — request j when the
    (j − N + 1)-th to end ended, as a first-come-first-served server with N slots admits it."""
    ends = sorted(ended_s)
    return [
        c if j < concurrency else max(c, ends[j - concurrency]) for j, c in enumerate(created_s)
    ]


@dataclass(frozen=True)
class Stream:
    """One request of a batch, timed at the client."""

    token_ids: tuple[int, ...]
    ttft_s: float
    """Request sent → first streamed chunk."""
    chunk_gaps_s: tuple[float, ...]
    """Between consecutive chunks (Outrider: a chunk a round; Hugging Face: a token a step)."""
    chunk_tokens: tuple[int, ...]
    """Tokens of the chunk that ends each gap."""
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    adaptive: bool = False
    """Whether the coordinator chose K per round (its statistics say so)."""
    pipeline: bool = False
    """Whether the rounds were pipelined (its statistics say so)."""
    rounds_by_k: tuple[int, ...] = ()
    """Rounds by the K the policy asked the draft for (its statistics)."""
    proposed_tokens: int = 0
    """Draft tokens proposed; ``draft_tokens`` were verified."""

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)


class StreamStats(TypedDict, total=False):
    """The coordinator's statistics a :class:`Stream` keeps."""

    rounds: int
    draft_tokens: int
    accepted_tokens: int
    adaptive: bool
    pipeline: bool
    rounds_by_k: tuple[int, ...]
    proposed_tokens: int


def stream_from_arrivals(
    token_ids: Sequence[int],
    sent_s: float,
    arrivals: Sequence[tuple[float, int]],
    **stats: Unpack[StreamStats],
) -> Stream:
    """A :class:`Stream` from when its request was sent and each chunk's (arrival time, tokens);
    chunks without tokens do not count."""
    chunks = [(t, n) for t, n in arrivals if n > 0]
    if not chunks:
        raise ValueError("a stream without a single token")
    return Stream(
        token_ids=tuple(token_ids),
        ttft_s=chunks[0][0] - sent_s,
        chunk_gaps_s=tuple(b[0] - a[0] for a, b in pairwise(chunks)),
        chunk_tokens=tuple(n for _, n in chunks[1:]),
        **stats,
    )


@dataclass(frozen=True)
class Batch:
    """One configuration at one concurrency: its requests' streams in request
    order, and its wall time (first request sent → last stream ended)."""

    concurrency: int
    streams: tuple[Stream, ...]
    wall_s: float
    repeats: tuple[Batch, ...] = ()
    """The other batches of the same configuration and concurrency, where
    this one is their median (``--repeat``)."""
    index: int = 0
    """Which of the ``--repeat`` batches this is, in run order: batches of
    the same index ran in the same rotation, next to each other in time."""

    @property
    def tokens_per_s(self) -> float:
        tokens = sum(s.generated_tokens for s in self.streams)
        return tokens / self.wall_s if self.wall_s > 0 else 0.0


def median_batch(batches: Sequence[Batch]) -> Batch:
    """The batch of median tokens/s, holding the others as its ``repeats``."""
    median, others = median_run(batches, lambda b: -b.tokens_per_s)
    return replace(median, repeats=others)


@dataclass
class LoadConfig:
    """One way of serving N streams at once."""

    name: str
    family: str
    """``"hf"`` or ``"outrider"``."""
    run: Callable[[Sequence[Prompt], int, int, Callable[[int], None]], Batch] = field(repr=False)
    """``run(requests, concurrency, max_new_tokens, done)``; ``done(n)`` as n more requests end."""
    drafter: str | None = None
    k: int | None = None
    adaptive: bool = False
    pipeline: bool = False
    temperature: float = 0.0
    """0: greedy, its outputs checked; else sampled (a ``-t1`` twin), unchecked."""
    may_fail: bool = False
    """A failure leaves it out of the run, named in the report with its
    error, instead of stopping the run."""
