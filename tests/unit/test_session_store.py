"""The session store: limits on sessions and on the block pool, idempotent close."""

import pytest

from outrider.engine.kv_cache import BlockPool, KVCache
from outrider.errors import InvalidArgument, ResourceExhausted, SessionNotFound
from outrider.session import SessionStore


def test_store_limits_sessions():
    pool = BlockPool(num_blocks=8, block_size=4)
    store = SessionStore(max_sessions=2, pool=pool)
    store.create("a", [1], kv=KVCache(pool))
    store.create("b", [1], kv=KVCache(pool))
    with pytest.raises(ResourceExhausted, match="2 of 2 sessions"):
        store.create("c", [1], kv=KVCache(pool))
    store.close("a")
    store.create("c", [1], kv=KVCache(pool))


def test_a_new_session_gets_room_for_its_whole_history_or_is_refused():
    pool = BlockPool(num_blocks=3, block_size=4)
    store = SessionStore(max_sessions=8, pool=pool)
    store.create("a", [1] * 6, kv=KVCache(pool))  # 2 blocks
    with pytest.raises(
        ResourceExhausted,
        match="cache is full: the session needs 5 cached tokens, 4 of 12 are free",
    ):
        store.create("b", [1] * 5, kv=KVCache(pool))
    assert len(store) == 1 and pool.free_blocks == 1
    store.create("b", [1] * 4, kv=KVCache(pool))
    assert pool.free_blocks == 0


def test_store_close_frees_the_cache_and_is_idempotent():
    pool = BlockPool(num_blocks=8, block_size=4)
    store = SessionStore(max_sessions=8, pool=pool)
    session = store.create("a", [1, 2, 3], kv=KVCache(pool))
    session.kv.appended([1, 2, 3])
    assert store.cached_tokens == 3 and store.usage == 1 / 8
    store.close("a")
    store.close("a")
    assert store.cached_tokens == 0 and len(store) == 0 and pool.free_blocks == 8
    assert session.kv.freed
    with pytest.raises(SessionNotFound):
        store.get("a")


def test_store_refuses_a_duplicate_session_id():
    pool = BlockPool(num_blocks=8, block_size=4)
    store = SessionStore(max_sessions=8, pool=pool)
    store.create("a", [1], kv=KVCache(pool))
    with pytest.raises(InvalidArgument):
        store.create("a", [1], kv=KVCache(pool))
