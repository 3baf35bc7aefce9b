"""Which sessions' tokens run in the next step.

Like vLLM v1's scheduler, this one knows no "prefill phase" or "decode
phase": each step it hands pending feeds a number of tokens under one token
budget, and the runner runs them all as one forward pass. Two kinds of feed
wait here:

* **rounds** — feeds that want logits (a target's verify, a draft's
  proposal step): someone is waiting for a token. Each runs whole, oldest
  first, while the budget lasts; a verify whose drafts do not all fit what
  is left runs a prefix of them instead of waiting a step (a prefix of the
  drafts is a proposal too, as vLLM's scheduler trims speculative tokens to
  its budget).
* **prefills** — feeds that only fill a cache (a session opening on its
  history). They take what the rounds left of the budget, oldest first, in
  chunks, so a long prompt arriving mid-flight costs running sessions at
  most one budget's worth of step time, never a whole prefill.

The first feed of a step always gets tokens, so every step makes progress;
a round larger than the whole budget runs first in its steps, in chunks that
keep the tokens whose logits are wanted in its last one. So does a session's
catch-up past what the runner's CUDA graphs hold a row (a draft syncing the
tokens committed while it drafted none): a few replayed steps cost less than
one eager one, and far less than a shape's first.

Chunks protect the sessions beside a prompt. A prompt with none beside it —
the only feed waiting, on an empty cache whose blocks follow each other,
while no other session holds a block — runs whole, up to
``max_prefill_tokens``: one causal pass over its blocks in place, as
transformers prefills, where chunks would each pay their share of the
weights' reads and a masked attention. Pure bookkeeping: no threads, and of
tensors only slices.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from outrider.engine.kv_cache import KVCache

CATCH_UP_CHUNKS = 4
"""The most graphed steps a catch-up is split into: an eager step of the
default model costs about ten replays on a GPU, and a shape's first eager
step far more (docs/benchmark.md#a-steps-cost)."""


@dataclass
class Feed:
    """What a job asks of the engine: append ``tokens`` to the session's
    cache ``kv`` and hand back the next-token logits of the last
    ``num_logits`` of them (0: none, a prefill)."""

    kv: KVCache
    tokens: list[int]
    num_logits: int = 1
    trimmable: int = 0
    """How many of its last tokens may be left out when the step has no
    room for them (a round's drafts: a prefix of them is a proposal too);
    the logits then come back for the tokens that ran."""
    hidden: torch.Tensor | None = None
    """An EAGLE head's other input, ``[len(tokens), H]``: beside each
    token, the feature of the position before it."""
    features: list[torch.Tensor] | None = None
    """A target's: where the runner appends the hidden states at the layers
    ``feature_layers`` of every token it runs, chunk by chunk (None: none wanted)."""
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("a feed needs at least one token")
        if not 0 <= self.num_logits <= len(self.tokens):
            raise ValueError(
                f"num_logits = {self.num_logits} for a feed of {len(self.tokens)} tokens"
            )
        if self.trimmable < 0 or (
            self.trimmable
            and (self.trimmable >= self.num_logits or self.num_logits != len(self.tokens))
        ):
            raise ValueError(
                f"trimmable = {self.trimmable}: only tokens that all want logits can be left "
                f"out, and not all of them ({self.num_logits} of {len(self.tokens)} want logits)"
            )


@dataclass
class Row:
    """One session's share of a step: ``tokens`` go after the ``len(kv)``
    cached ones; the logits of the last ``num_logits`` are wanted."""

    kv: KVCache
    tokens: list[int]
    num_logits: int
    hidden: torch.Tensor | None = None
    features: list[torch.Tensor] | None = None
    feature_layers: tuple[int, ...] = ()


def _row(feed: Feed, start: int, count: int, num_logits: int) -> Row:
    """Tokens ``start .. start + count`` of ``feed`` as a row of a step."""
    hidden = None if feed.hidden is None else feed.hidden[start : start + count]
    tokens = feed.tokens[start : start + count]
    return Row(feed.kv, tokens, num_logits, hidden, feed.features, feed.feature_layers)


@dataclass
class _Pending:
    feed: Feed
    owner: Any
    order: int
    done: int = 0
    """Tokens of the feed already run (chunked prefill)."""


@dataclass
class Scheduled:
    """A row of the step and the pending feed it came from."""

    row: Row
    pending: _Pending = field(repr=False)
    trimmed: bool = False
    """Its feed's last tokens were left out: it finishes with this row."""

    @property
    def finishes(self) -> bool:
        done = self.pending.done + len(self.row.tokens)
        return self.trimmed or done == len(self.pending.feed.tokens)


class Scheduler:
    def __init__(
        self, *, max_tokens_per_step: int, max_rows: int, max_prefill_tokens: int = 0
    ) -> None:
        if max_tokens_per_step < 1 or max_rows < 1:
            raise ValueError("a step needs room for at least one token and one row")
        self.max_tokens_per_step = max_tokens_per_step
        self.max_rows = max_rows
        self.max_prefill_tokens = max_prefill_tokens
        self._pending: list[_Pending] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, feed: Feed, owner: Any) -> None:
        """Queues ``feed``; ``owner`` is handed back when it has run."""
        self._pending.append(_Pending(feed, owner, next(self._order)))

    def drop_closed(self) -> list[Any]:
        """Forgets the feeds of sessions closed meanwhile; returns their owners."""
        closed = [p for p in self._pending if p.feed.kv.freed]
        self._pending = [p for p in self._pending if not p.feed.kv.freed]
        return [p.owner for p in closed]

    def owners(self) -> list[Any]:
        """The owners of every queued feed."""
        return [p.owner for p in self._pending]

    def discard(self, owners: Iterable[Any]) -> list[Any]:
        """Forgets the feeds of ``owners`` (their step failed); returns those owners."""
        gone = {id(owner): owner for owner in owners}
        self._pending = [p for p in self._pending if id(p.owner) not in gone]
        return list(gone.values())

    def schedule(self, graphed_tokens_per_row: int = 0) -> list[Scheduled]:
        """The rows of the next step (rounds whole, then prefill chunks); a
        catch-up of a session already cached, past ``graphed_tokens_per_row``
        (0: the runner has no CUDA graphs), in chunks the graphs hold."""
        budget = self.max_tokens_per_step
        if self._alone():
            budget = max(budget, len(self._pending[0].feed.tokens))
        step: list[Scheduled] = []
        rounds = [p for p in self._pending if p.feed.num_logits]
        prefills = [p for p in self._pending if not p.feed.num_logits]
        for pending in rounds:
            if len(step) == self.max_rows:
                break
            left = len(pending.feed.tokens) - pending.done
            if left <= budget:
                take = self._catch_up_chunk(pending, left, graphed_tokens_per_row)
            elif left - pending.feed.trimmable <= budget:
                step.append(self._trimmed(pending, budget))  # a prefix fits: it runs now
                budget = 0
                continue
            elif step:
                continue  # waits for a step with room for it
            elif left > pending.feed.num_logits:
                take = min(
                    budget, left - pending.feed.num_logits
                )  # a chunk before the tokens whose logits are wanted
            else:
                take = left  # those alone exceed the budget: they run whole, or never would
            step.append(self._take(pending, take))
            budget -= take
        for pending in prefills:
            if len(step) == self.max_rows or budget <= 0:
                break
            take = min(len(pending.feed.tokens) - pending.done, budget)
            step.append(self._take(pending, take))
            budget -= take
        return step

    @staticmethod
    def _catch_up_chunk(pending: _Pending, left: int, graphed: int) -> int:
        """Tokens of a round to run now: all ``left``, or the next chunk of a
        catch-up past the graphs (not an opening prompt's, which runs as a
        prefill does) that fits :data:`CATCH_UP_CHUNKS` chunks."""
        feed = pending.feed
        catching_up = len(feed.kv) > 0 and graphed < left <= CATCH_UP_CHUNKS * graphed
        if not catching_up or left <= feed.num_logits:
            return left
        return min(graphed, left - feed.num_logits)

    def _alone(self) -> bool:
        """Whether the one feed waiting is a prompt that fits
        ``max_prefill_tokens``, on an empty cache whose blocks follow each
        other, and no other session holds a block."""
        if len(self._pending) != 1:
            return False
        pending = self._pending[0]
        kv = pending.feed.kv
        return (
            pending.done == 0
            and len(kv) == 0
            and len(pending.feed.tokens) <= self.max_prefill_tokens
            and kv.pool.used_blocks == len(kv.blocks)
            and kv.in_order(len(kv.blocks))
        )

    @staticmethod
    def _trimmed(pending: _Pending, count: int) -> Scheduled:
        """The first ``count`` tokens of a trimmable feed, which then ends."""
        feed = pending.feed
        left_out = len(feed.tokens) - count
        return Scheduled(_row(feed, 0, count, feed.num_logits - left_out), pending, trimmed=True)

    @staticmethod
    def _take(pending: _Pending, count: int) -> Scheduled:
        feed = pending.feed
        finishes = pending.done + count == len(feed.tokens)
        row = _row(feed, pending.done, count, feed.num_logits if finishes else 0)
        return Scheduled(row, pending)

    def update(self, step: Sequence[Scheduled], outputs: Sequence[Any]) -> list[tuple[Any, Any]]:
        """Records that ``step`` ran; returns ``(owner, output)`` for every feed it finished."""
        finished, finished_ids = [], set()
        for scheduled, output in zip(step, outputs, strict=True):
            if scheduled.finishes:
                finished.append((scheduled.pending.owner, output))
                finished_ids.add(id(scheduled.pending))
            scheduled.pending.done += len(scheduled.row.tokens)
        self._pending = [p for p in self._pending if id(p) not in finished_ids]
        return finished
