"""The session store: limits, idempotent close, and rollback by crop."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from outrider.errors import InvalidArgument, ResourceExhausted, SessionNotFound
from outrider.runner import ModelRunner
from outrider.session import KVCache, SessionStore


@pytest.fixture(scope="module")
def runner():
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return ModelRunner(LlamaForCausalLM(config).to(torch.float64).eval())


def test_crop_keeps_a_prefix_without_copying(runner):
    kv = runner.new_kv()
    runner.feed(kv, [1, 2, 3, 4, 5, 6])
    keys_before = kv.cache.layers[0].keys
    kv.crop(4)
    assert kv.token_ids == [1, 2, 3, 4]
    assert kv.cache.get_seq_length() == 4
    # A view of the same storage: rollback does not copy the cache.
    assert kv.cache.layers[0].keys.untyped_storage().data_ptr() == keys_before.untyped_storage().data_ptr()


def test_logits_after_crop_equal_logits_of_a_fresh_prefill(runner):
    kv = runner.new_kv()
    runner.feed(kv, [1, 2, 3, 9, 9])
    kv.crop(3)
    after_rollback = runner.feed(kv, [4, 5])
    fresh = runner.new_kv()
    expected = runner.feed(fresh, [1, 2, 3, 4, 5])[-2:]
    torch.testing.assert_close(after_rollback, expected)


def test_extend_reuses_the_shared_prefix_and_feeds_the_rest(runner):
    kv = runner.new_kv()
    runner.feed(kv, [1, 2, 3, 7, 8])  # 7, 8: speculative, later rejected
    logits = runner.extend(kv, [1, 2, 3, 4])
    assert logits.shape[0] == 1  # only token 4 was fed
    assert kv.token_ids == [1, 2, 3, 4]


def test_extend_always_feeds_the_last_token(runner):
    kv = runner.new_kv()
    runner.feed(kv, [1, 2, 3])
    logits = runner.extend(kv, [1, 2, 3])
    assert logits.shape[0] == 1 and kv.token_ids == [1, 2, 3]


def test_crop_cannot_grow(runner):
    kv = runner.new_kv()
    runner.feed(kv, [1, 2])
    with pytest.raises(ValueError):
        kv.crop(3)


def test_store_limits_sessions():
    store = SessionStore(max_sessions=2, max_cached_tokens=100)
    store.create("a", [1])
    store.create("b", [1])
    with pytest.raises(ResourceExhausted, match="2 of 2 sessions"):
        store.create("c", [1])
    store.close("a")
    store.create("c", [1])


def test_store_limits_cached_tokens(runner):
    store = SessionStore(max_sessions=8, max_cached_tokens=10)
    a = store.create("a", [1] * 6, kv=runner.new_kv())
    runner.feed(a.kv, [1] * 6)
    with pytest.raises(ResourceExhausted, match="cache is full"):
        store.create("b", [1] * 5, kv=runner.new_kv())
    assert len(store) == 1
    with pytest.raises(ResourceExhausted):
        store.reserve(a, 11)
    store.reserve(a, 10)


def test_store_close_frees_the_cache_and_is_idempotent(runner):
    store = SessionStore(max_sessions=8, max_cached_tokens=100)
    session = store.create("a", [1, 2, 3], kv=runner.new_kv())
    runner.feed(session.kv, [1, 2, 3])
    assert store.cached_tokens == 3
    store.close("a")
    store.close("a")
    assert store.cached_tokens == 0 and len(store) == 0
    with pytest.raises(SessionNotFound):
        store.get("a")


def test_store_refuses_a_duplicate_session_id():
    store = SessionStore(max_sessions=8, max_cached_tokens=100)
    store.create("a", [1])
    with pytest.raises(InvalidArgument):
        store.create("a", [1])


def test_kv_cache_shared_prefix():
    kv = KVCache(DynamicCache(), [1, 2, 3, 4])
    assert kv.shared_prefix([1, 2, 9]) == 2
    assert kv.shared_prefix([1, 2, 3, 4, 5]) == 4
    assert kv.shared_prefix([]) == 0
