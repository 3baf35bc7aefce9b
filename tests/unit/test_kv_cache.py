"""The block pool and a session's blocks: reserve, crop (rollback), free."""

import pytest

from outrider.engine.kv_cache import NULL_BLOCK, BlockPool, KVCache
from outrider.errors import ResourceExhausted


def cache_with(pool: BlockPool, tokens: list[int]) -> KVCache:
    kv = KVCache(pool)
    kv.reserve(len(tokens))
    kv.appended(tokens)
    return kv


def test_the_null_block_is_never_handed_out():
    pool = BlockPool(num_blocks=4, block_size=2)
    assert sorted(pool.allocate(4)) == [1, 2, 3, 4]
    assert NULL_BLOCK == 0 and pool.free_blocks == 0


def test_reserve_takes_whole_blocks_and_only_what_is_missing():
    pool = BlockPool(num_blocks=8, block_size=4)
    kv = KVCache(pool)
    kv.reserve(5)
    assert len(kv.blocks) == 2 and pool.free_blocks == 6
    kv.reserve(8)
    assert len(kv.blocks) == 2
    kv.reserve(9)
    assert len(kv.blocks) == 3


def test_a_reserve_the_pool_cannot_meet_changes_nothing():
    pool = BlockPool(num_blocks=2, block_size=4)
    kv = cache_with(pool, [1, 2, 3])
    with pytest.raises(ResourceExhausted, match="needs 9 cached tokens, 5 of 8 are free"):
        kv.reserve(9)
    assert len(kv.blocks) == 1 and pool.free_blocks == 1


def test_crop_sets_the_length_and_returns_the_blocks_beyond_it():
    pool = BlockPool(num_blocks=8, block_size=4)
    kv = cache_with(pool, list(range(10)))  # 3 blocks
    first_blocks = list(kv.blocks)
    kv.crop(5)
    assert kv.token_ids == [0, 1, 2, 3, 4]
    assert kv.blocks == first_blocks[:2]  # the same blocks: nothing moved
    assert pool.free_blocks == 6
    kv.crop(5)
    assert kv.blocks == first_blocks[:2]


def test_crop_cannot_grow():
    kv = cache_with(BlockPool(4, 4), [1, 2])
    with pytest.raises(ValueError):
        kv.crop(3)


def test_appending_past_the_reserved_blocks_is_refused():
    kv = cache_with(BlockPool(4, 4), [1, 2, 3])
    with pytest.raises(ValueError):
        kv.appended([4, 5])


def test_free_hands_back_every_block():
    pool = BlockPool(num_blocks=4, block_size=4)
    kv = cache_with(pool, list(range(9)))
    kv.free()
    kv.free()
    assert pool.free_blocks == 4 and kv.freed and len(kv) == 0


def test_an_emptied_pool_hands_out_ascending_blocks_again():
    pool = BlockPool(num_blocks=8, block_size=1)
    first, second = cache_with(pool, [0] * 3), cache_with(pool, [0] * 3)
    first.free()
    assert cache_with(pool, [0] * 5).blocks != [1, 2, 3, 4, 5]  # interleaved while one holds
    pool = BlockPool(num_blocks=8, block_size=1)
    first, second = cache_with(pool, [0] * 3), cache_with(pool, [0] * 3)
    first.free()
    second.free()
    assert cache_with(pool, [0] * 5).blocks == [1, 2, 3, 4, 5]


def test_shared_prefix_starts_where_the_caller_knows_they_agree():
    kv = cache_with(BlockPool(4, 4), [1, 2, 3, 4])
    assert kv.shared_prefix([1, 2, 9]) == 2
    assert kv.shared_prefix([1, 2, 3, 4, 5]) == 4
    assert kv.shared_prefix([]) == 0
    assert kv.shared_prefix([1, 2, 3, 7], start=2) == 3
