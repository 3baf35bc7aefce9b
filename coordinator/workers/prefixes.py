"""Prefix-aware routing: which replica of a role most likely holds a new
session's prefix in its cache, balanced against load.

The coordinator remembers, per replica, the names (:mod:`outrider.prefix`)
of the prompt blocks it sent there, least recently sent forgotten first —
its guess of what that replica's prefix cache holds, as SGLang's router
keeps an approximate tree per worker and llm-d's scheduler an index of the
blocks it routed. No replica is asked: a guess costs a dictionary lookup
per block, and a wrong one costs only a prefill.

Load bounds the choice (consistent hashing with bounded loads, Mirrokni et
al. 2018): a replica may take a session only while its sessions stay
within ``BALANCE`` times the mean (one more, rounded up), so one hot prefix
fills its replica to that bound and then spills to the next best; among
the replicas within it, the longest cached prefix wins, then the least
loaded.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar

from outrider.prefix import block_names

BALANCE = 1.25
"""How far above the mean load a replica may go for a prefix it holds."""
BLOCKS_REMEMBERED = 1 << 16
"""Names remembered per replica (a million tokens of blocks of 16)."""


class Loaded(Protocol):
    load: int
    """Sessions this coordinator has open on it."""


R = TypeVar("R", bound=Loaded)


def prompt_names(tokens: Sequence[int]) -> list[bytes]:
    """The names of the blocks a worker can take from its cache for a
    session on ``tokens``: every full block but the last token's."""
    return block_names(tokens[:-1])


class PrefixIndex:
    """The prompt blocks sent to each replica, least recently sent first."""

    def __init__(self, blocks_remembered: int = BLOCKS_REMEMBERED) -> None:
        self.blocks_remembered = blocks_remembered
        self._sent: dict[object, OrderedDict[bytes, None]] = {}

    def matched(self, replica: object, names: Sequence[bytes]) -> int:
        """How many of ``names``, from the first, were sent to ``replica``."""
        sent = self._sent.get(replica)
        if not sent:
            return 0
        for i, name in enumerate(names):
            if name not in sent:
                return i
        return len(names)

    def sent(self, replica: object, names: Sequence[bytes]) -> None:
        """``replica`` was sent a session on the blocks ``names``."""
        sent = self._sent.setdefault(replica, OrderedDict())
        for name in names:
            sent[name] = None
            sent.move_to_end(name)
        while len(sent) > self.blocks_remembered:
            sent.popitem(last=False)

    def forget(self, replica: object) -> None:
        """``replica`` is gone (or lost its cache)."""
        self._sent.pop(replica, None)

    def choose(self, candidates: Sequence[R], names: Sequence[bytes]) -> list[R]:
        """``candidates`` in the order they should take a session on
        ``names``: those within the load bound first, by the prefix they
        hold (longest first), then by load; the rest after, by load."""
        cap = math.ceil(BALANCE * (sum(r.load for r in candidates) + 1) / len(candidates))
        within = [r for r in candidates if r.load + 1 <= cap]
        matched = {id(r): self.matched(r, names) for r in within}
        ranked = sorted(within, key=lambda r: (-matched[id(r)], r.load))
        return ranked + sorted((r for r in candidates if r.load + 1 > cap), key=lambda r: r.load)
