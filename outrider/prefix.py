"""The names of token prefixes: a chain of hashes, one per full block.

Block ``j`` of a sequence is named by the hash of (block ``j - 1``'s name,
its own ``block_size`` token ids), so one name stands for the whole prefix
up to the end of its block, as vLLM v1 names its cache blocks. A worker's
prefix cache (:mod:`outrider.engine.kv_cache`) finds a prompt's cached
blocks by these names, and the coordinator routes a session to the replica
that was last sent its prefix (:mod:`outrider.coordinator.workers.prefixes`) by the
same names. No torch: the coordinator imports this.

SHA-256, not Python's ``hash``: a collision would hand one request another
request's cache, so names must not be forgeable (vLLM chose SHA-256 for the
same reason). One block's name costs about a microsecond.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

BLOCK_SIZE = 16
"""Tokens per block (vLLM's default), of the workers' KV caches and of the
coordinator's routing."""

ROOT = b""
"""The name before a sequence's first block."""


def block_name(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a block of ``tokens`` that follows the block named ``parent``."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def block_names(
    tokens: Sequence[int], block_size: int = BLOCK_SIZE, *, start: int = 0, parent: bytes = ROOT
) -> list[bytes]:
    """The names of the full blocks of ``tokens`` from block ``start`` on,
    ``parent`` being block ``start - 1``'s."""
    return list(iter_block_names(tokens, block_size, start=start, parent=parent))


def iter_block_names(
    tokens: Sequence[int], block_size: int = BLOCK_SIZE, *, start: int = 0, parent: bytes = ROOT
) -> Iterator[bytes]:
    """:func:`block_names`, each named only when asked for."""
    for begin in range(start * block_size, len(tokens) - block_size + 1, block_size):
        parent = block_name(parent, tokens[begin : begin + block_size])
        yield parent
