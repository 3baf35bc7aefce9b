"""The prefix cache of the block pool: sealed blocks named, shared by
reference, kept after their sessions end, evicted least recently used —
and never a refusal that a pool without the cache would not give."""

import random

import pytest

from outrider.engine.kv_cache import BlockPool, KVCache
from outrider.errors import ResourceExhausted
from outrider.prefix import block_name, block_names


def opened(pool: BlockPool, tokens: list[int], *, seal: bool = True) -> KVCache:
    """A session as a worker opens one: reuse, reserve, prefill the rest, seal."""
    kv = KVCache(pool)
    kv.reuse(tokens)
    kv.reserve(len(tokens))
    kv.appended(tokens[len(kv) :])
    if seal:
        kv.seal(len(kv))
    return kv


def test_names_chain_each_block_to_the_prefix_before_it():
    a, b = list(range(8)), [*range(4), *range(10, 14)]
    assert block_names(a, 4)[0] == block_names(b, 4)[0]
    assert block_names(a, 4)[1] != block_names(b, 4)[1]
    assert block_names(a, 4)[1] == block_name(block_names(a, 4)[0], a[4:])
    assert block_names(a[:7], 4) == block_names(a, 4)[:1]  # full blocks only
    # The same block after another prefix has another name.
    assert block_names([9, 9, 9, 9, *a[4:]], 4)[1] != block_names(a, 4)[1]


def test_a_closed_sessions_sealed_blocks_serve_the_next_session_on_its_prefix():
    pool = BlockPool(num_blocks=8, block_size=4, caching=True)
    first = opened(pool, list(range(10)))  # blocks 0-3, 4-7 sealed; 8-9 not
    blocks = list(first.blocks)
    first.free()
    assert pool.used_blocks == 0 and pool.cached_blocks == 2

    second = KVCache(pool)
    assert second.reuse([*range(9), 99]) == 8
    assert second.blocks == blocks[:2] and second.token_ids == list(range(8))
    assert pool.used_blocks == 2 and pool.free_blocks == 6

    other = KVCache(pool)
    assert other.reuse([0, 1, 2, 99, 4, 5, 6, 7]) == 0  # differs in the first block


def test_a_pool_without_the_cache_names_nothing():
    pool = BlockPool(num_blocks=8, block_size=4)
    opened(pool, list(range(10))).free()
    assert pool.cached_blocks == 0
    assert KVCache(pool).reuse(list(range(10))) == 0


def test_shared_blocks_stay_held_until_the_last_session_lets_go():
    pool = BlockPool(num_blocks=8, block_size=4, caching=True)
    a = opened(pool, list(range(8)))
    b = opened(pool, [*range(8), 42])
    assert b.blocks[:2] == a.blocks
    a.free()
    assert pool.used_blocks == 3  # b's two shared blocks and its own
    b.free()
    assert pool.used_blocks == 0 and pool.cached_blocks == 2


def test_a_sealed_block_is_never_cropped_and_appends_go_to_new_blocks():
    pool = BlockPool(num_blocks=8, block_size=4, caching=True)
    kv = opened(pool, list(range(8)))
    with pytest.raises(ValueError, match="8 of them sealed"):
        kv.crop(7)
    kv.reserve(11)
    kv.appended([8, 9, 10])
    kv.crop(8)  # a rejected draft's rollback: to the sealed boundary
    assert kv.token_ids == list(range(8)) and len(kv.blocks) == 2


def test_sealing_names_only_the_full_blocks_of_final_tokens():
    pool = BlockPool(num_blocks=8, block_size=4, caching=True)
    kv = KVCache(pool)
    kv.reserve(12)
    kv.appended(list(range(12)))
    kv.seal(7)  # tokens 7.. are drafts: block 4-7 is not all final
    assert kv.names == block_names(list(range(4)), 4)
    kv.crop(7)
    kv.seal(11)  # (only 7 held)
    assert len(kv.names) == 1


def test_a_prefix_two_sessions_computed_at_once_keeps_the_first_block():
    pool = BlockPool(num_blocks=8, block_size=4, caching=True)
    a, b = KVCache(pool), KVCache(pool)
    for kv in (a, b):
        kv.reserve(4)
        kv.appended([1, 2, 3, 4])
    a.seal(4)
    b.seal(4)
    assert pool.cached_blocks == 1
    b.free()  # its copy held no name: plainly free
    assert KVCache(pool).reuse([1, 2, 3, 4, 5]) == 4
    a.free()


def test_eviction_takes_uncached_blocks_first_then_the_least_recently_used_tails():
    pool = BlockPool(num_blocks=6, block_size=2, caching=True)
    old = opened(pool, [1, 2, 3, 4])  # 2 blocks
    new = opened(pool, [5, 6, 7, 8])
    old.free()
    new.free()  # the most recently used
    assert pool.free_blocks == 6 and pool.cached_blocks == 4
    kv = KVCache(pool)
    kv.reserve(6)  # 2 uncached blocks, then old's tail
    assert pool.cached_blocks == 3
    assert KVCache(pool).reuse([1, 2, 3, 4]) == 2  # old's head is still there
    assert KVCache(pool).reuse([5, 6, 7, 8, 9]) == 4


def test_a_reuse_that_then_cannot_reserve_its_history_holds_nothing():
    from outrider.session import SessionStore

    pool = BlockPool(num_blocks=3, block_size=2, caching=True)
    opened(pool, [1, 2, 3, 4]).free()
    store = SessionStore(max_sessions=4, pool=pool)
    with pytest.raises(ResourceExhausted):
        store.create("s", [1, 2, 3, 4, 5, 6, 7, 8, 9], kv=KVCache(pool))
    assert pool.used_blocks == 0 and pool.cached_blocks == 2


def test_the_cache_never_refuses_what_a_pool_without_it_accepts():
    """The same random sessions — opened on a few shared prefixes, growing by
    rounds that append drafts and roll back, closing — on a pool with the
    cache and one without: every reserve the plain pool grants, the
    caching pool grants too."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    plain, caching = BlockPool(24, 4), BlockPool(24, 4, caching=True)
    live: list[tuple[KVCache, KVCache, list[int]]] = []
    refused = granted = 0
    for _ in range(3000):
        action = rng.random()
        if action < 0.25 or not live:
            tokens = [*rng.choice(prefixes), *(rng.randrange(50) for _ in range(rng.randrange(3)))]
            try:
                p = opened(plain, tokens, seal=False)
            except ResourceExhausted:
                refused += 1
                continue
            live.append((p, opened(caching, tokens), tokens))  # raises if refused
            granted += 1
        elif action < 0.35:
            p, c, _ = live.pop(rng.randrange(len(live)))
            p.free()
            c.free()
        else:  # a round: drafts appended, some rejected, one token committed
            p, c, tokens = rng.choice(live)
            drafts = [rng.randrange(50) for _ in range(rng.randrange(1, 5))]
            try:
                p.reserve(len(p) + len(drafts))
            except ResourceExhausted:
                refused += 1
                continue
            c.reserve(len(c) + len(drafts))
            for kv in (p, c):
                kv.appended(drafts)
            accepted = rng.randrange(len(drafts) + 1)
            tokens.extend(drafts[:accepted])
            for kv in (p, c):
                kv.crop(len(tokens))
            c.seal(len(c))
    assert granted > 100 and refused > 10  # the pools were full often
