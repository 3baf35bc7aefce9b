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

With a prefix cache (on unless the engine says otherwise; vLLM v1's
automatic prefix caching), the pool also keeps what sessions computed:

* **Seal** (:meth:`KVCache.seal`): a worker says which of a session's
  tokens are final — committed, never to be rolled back — and their full
  blocks are named by the hash chain of :mod:`outrider.prefix`. A sealed
  block is never written again: a crop stops at it, and appends fill the
  blocks after it.
* **Reuse** (:meth:`KVCache.reuse`): a session opening on a history takes
  the named blocks of its longest cached prefix, by reference, and
  prefills only the rest.
* A named block whose last session closed stays cached, free for the pool
  to evict (least recently used, the tail of a prefix first) when a
  reserve needs its room — so the cache never refuses a reserve that a
  pool without it would grant.

This module is bookkeeping only. The tensors that hold the keys and values
belong to the model runner (:mod:`outrider.engine.runner`), indexed by block
id; the unbatched fallback runner keeps transformers ``DynamicCache``\\ s
instead and uses blocks of one token, so that memory is accounted the same
way whichever runner a worker has.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from outrider.errors import ResourceExhausted
from outrider.prefix import ROOT, block_names, iter_block_names

NULL_BLOCK = 0
"""Never owned by a session: padding in a batch points here (vLLM's null block)."""


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots, ids ``1 .. num_blocks``;
    with ``caching``, a prefix cache over them.

    Each block has a reference count: the sessions whose caches hold it. A
    block no session holds is free. Without caching it is simply free; with
    caching a block that was *sealed* (full of final tokens, named by
    :func:`outrider.prefix.block_name`) keeps its name and contents when its
    last session lets go, and waits, least recently used first, until a
    session opening on the same prefix takes it back (:meth:`share`) or an
    allocation needs its room (it is then evicted: its name forgotten). So a
    cached block costs no session room: :attr:`free_blocks` counts it.
    """

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a pool needs at least one block of one slot, got {num_blocks} × {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free = list(range(num_blocks, NULL_BLOCK, -1))  # popped from the end: low ids first
        """Free blocks holding nothing cached."""
        self._cached: OrderedDict[int, None] = OrderedDict()
        """Free blocks holding a cached prefix, least recently used first."""
        self._refs = [0] * (num_blocks + 1)
        self._name_of: dict[int, bytes] = {}
        self._block_named: dict[bytes, int] = {}

    @property
    def capacity(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        """Blocks no session holds, cached ones included (an allocation may evict them)."""
        return len(self._free) + len(self._cached)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks with a name: sealed by a session, held or not."""
        return len(self._block_named)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for one session: uncached ones first, then the least
        recently used cached ones, evicted."""
        if n > self.free_blocks:
            raise ValueError(f"{n} blocks asked, {self.free_blocks} free")
        plain = min(n, len(self._free))
        taken = self._free[len(self._free) - plain :][::-1]  # ascending: they follow each other
        del self._free[len(self._free) - plain :]
        for _ in range(n - plain):
            block, _ = self._cached.popitem(last=False)
            del self._block_named[self._name_of.pop(block)]
            taken.append(block)
        for block in taken:
            self._refs[block] = 1
        return taken

    def free(self, blocks: Sequence[int]) -> None:
        """Lets go of ``blocks``: each is free when no session holds it any
        more, its contents cached if it has a name. The last block first, so
        a prefix's tail is evicted before its head (which other prefixes may share)."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._name_of:
                self._cached[block] = None
            else:
                self._free.append(block)
        if self.used_blocks == 0:  # nothing held: uncached blocks ascending from 1, as new
            self._free.sort(reverse=True)

    def cached_prefix(self, names: Iterable[bytes]) -> list[tuple[bytes, int]]:
        """The names and cached blocks of the longest prefix of ``names``
        (taken no further than its first miss)."""
        found = []
        for name in names:
            block = self._block_named.get(name)
            if block is None:
                break
            found.append((name, block))
        return found

    def share(self, blocks: Sequence[int]) -> None:
        """One more session holds ``blocks`` (cached ones)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1

    def name(self, block: int, name: bytes) -> None:
        """Caches ``block`` (held, full, final) as ``name`` — unless another
        block already holds that prefix (two sessions computed it at once:
        the first keeps the name, the second block stays private)."""
        if self.caching and name not in self._block_named and block not in self._name_of:
            self._block_named[name] = block
            self._name_of[block] = name


class KVCache:
    """One session's cache: the ids of the tokens it holds and the blocks
    that hold them. (The fallback runner's subclass also keeps the session's
    ``DynamicCache``.)"""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.token_ids: list[int] = []
        self.blocks: list[int] = []
        self.names: list[bytes] = []
        """The names of its first blocks, those sealed: final, maybe shared."""
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
        back the blocks beyond them; never into a sealed block."""
        if not len(self.names) * self.pool.block_size <= length <= len(self):
            raise ValueError(
                f"cannot crop a cache of {len(self)} tokens, "
                f"{len(self.names) * self.pool.block_size} of them sealed, to {length}"
            )
        del self.token_ids[length:]
        keep = self.pool.blocks_for(length)
        if keep < len(self.blocks):
            self.pool.free(self.blocks[keep:])
            del self.blocks[keep:]

    def free(self) -> None:
        """Hands back every block (idempotent); a freed cache is never used again."""
        self.names.clear()
        self.crop(0)
        self.freed = True

    def reuse(self, tokens: Sequence[int]) -> int:
        """Takes, into an empty cache, the cached blocks of the longest
        prefix of ``tokens`` that the pool holds (whole blocks only);
        returns how many tokens they hold (0: none, or the pool caches nothing)."""
        if len(self):
            raise ValueError("only an empty cache reuses a cached prefix")
        if not self.pool.caching:
            return 0
        # Named lazily: the blocks after the first miss are named once,
        # when the session seals them.
        found = self.pool.cached_prefix(iter_block_names(tokens, self.pool.block_size))
        self.names = [name for name, _ in found]
        self.blocks = [block for _, block in found]
        self.pool.share(self.blocks)
        self.token_ids = list(tokens[: len(self.blocks) * self.pool.block_size])
        return len(self)

    def seal(self, length: int) -> None:
        """Says its first ``length`` tokens are final: never cropped away.
        Its full blocks among them are named, so other sessions may share
        them (a pool that caches), and no crop reaches them again."""
        if not self.pool.caching:
            return
        size = self.pool.block_size
        full = min(length, len(self)) // size
        if full <= len(self.names):
            return
        start = len(self.names)
        parent = self.names[-1] if self.names else ROOT
        new = block_names(self.token_ids[: full * size], size, start=start, parent=parent)
        for block, name in zip(self.blocks[start:full], new, strict=True):
            self.pool.name(block, name)
        self.names.extend(new)
