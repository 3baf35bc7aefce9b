"""KV cache memory: one pool of fixed-size blocks per worker, and each
session's share of it.

The pool is sized once, from the memory budget (:mod:`outrider.memory`), and
never grows. A session's :class:`KVCache` is the ids of the tokens it holds,
in order, and the blocks that hold them: token ``i`` lives in block
``blocks[i // block_size]`` at slot ``i % block_size`` (vLLM's paged layout).

* **Append** reserves blocks for the new length first; when the pool has too
  few free blocks the session gets ``RESOURCE_EXHAUSTED`` and nothing else
  changes.
* **Rollback** (:meth:`KVCache.crop`) sets the length and hands back the
  blocks it no longer needs: nothing is copied, nothing is reallocated.
* **Close** (:meth:`KVCache.free`) hands back every block at once.

This module is bookkeeping only. The tensors that hold the keys and values
belong to the model runner (:mod:`outrider.engine.runner`), indexed by block
id; the unbatched fallback runner keeps transformers ``DynamicCache``\\ s
instead and uses blocks of one token, so that memory is accounted the same
way whichever runner a worker has.
"""

from __future__ import annotations

from collections.abc import Sequence

from outrider.errors import ResourceExhausted

NULL_BLOCK = 0
"""Never owned by a session: padding in a batch points here (vLLM's null block)."""


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots, ids ``1 .. num_blocks``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a pool needs at least one block of one slot, got {num_blocks} × {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks, NULL_BLOCK, -1))  # popped from the end: low ids first

    @property
    def capacity(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"{n} blocks asked, {len(self._free)} free")
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return taken[::-1]  # in ascending order: a fresh session's blocks follow each other

    def free(self, blocks: Sequence[int]) -> None:
        self._free.extend(reversed(blocks))
        if len(self._free) == self.num_blocks:  # empty again: ascending from block 1, as new
            self._free.sort(reverse=True)


class KVCache:
    """One session's cache: the ids of the tokens it holds and the blocks
    that hold them. (The fallback runner's subclass also keeps the session's
    ``DynamicCache``.)"""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.token_ids: list[int] = []
        self.blocks: list[int] = []
        self.freed = False

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def reserved(self) -> int:
        """Tokens the session's blocks can hold."""
        return len(self.blocks) * self.pool.block_size

    def shared_prefix(self, tokens: Sequence[int], start: int = 0) -> int:
        """Length of the longest common prefix of the cached ids and
        ``tokens``, given that their first ``start`` ids are known to agree."""
        n = start
        for cached, wanted in zip(self.token_ids[start:], tokens[start:], strict=False):
            if cached != wanted:
                break
            n += 1
        return n

    def in_order(self, blocks: int) -> bool:
        """Whether its first ``blocks`` blocks follow each other in the pool
        (as a session that grew alone holds them): they read as one span."""
        first = self.blocks[:blocks]
        return bool(first) and first == list(range(first[0], first[0] + len(first)))

    def reserve(self, length: int) -> None:
        """Makes room for ``length`` tokens, or raises ResourceExhausted and
        changes nothing."""
        missing = self.pool.blocks_for(length) - len(self.blocks)
        if missing <= 0:
            return
        if missing > self.pool.free_blocks:
            pool = self.pool
            free = pool.free_blocks * pool.block_size + self.reserved - len(self)
            raise ResourceExhausted(
                f"worker cache is full: the session needs {length} cached tokens, "
                f"{free} of {pool.capacity} are free; retry later, shorten the request, "
                "or use another replica"
            )
        self.blocks.extend(self.pool.allocate(missing))

    def appended(self, tokens: Sequence[int]) -> None:
        """Records that the runner wrote ``tokens`` after the cached ones."""
        if len(self) + len(tokens) > self.reserved:
            raise ValueError(
                f"{len(self) + len(tokens)} tokens do not fit {len(self.blocks)} reserved blocks"
            )
        self.token_ids.extend(tokens)

    def crop(self, length: int) -> None:
        """Keeps the first ``length`` tokens (rollback: no copy) and hands
        back the blocks beyond them."""
        if not 0 <= length <= len(self):
            raise ValueError(f"cannot crop a cache of {len(self)} tokens to {length}")
        del self.token_ids[length:]
        keep = self.pool.blocks_for(length)
        if keep < len(self.blocks):
            self.pool.free(self.blocks[keep:])
            del self.blocks[keep:]

    def free(self) -> None:
        """Hands back every block (idempotent); a freed cache is never used again."""
        self.crop(0)
        self.freed = True
