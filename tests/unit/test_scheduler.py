"""The scheduler: rounds whole and first, prefills chunked into what is left, progress always."""

import pytest

from outrider.engine.kv_cache import BlockPool, KVCache
from outrider.engine.scheduler import Feed, Scheduler

POOL = BlockPool(num_blocks=1024, block_size=16)


def feed(n: int, num_logits: int = 1) -> Feed:
    return Feed(KVCache(POOL), list(range(n)), num_logits)


def cached(tokens: int) -> KVCache:
    """A session's cache holding ``tokens`` tokens."""
    kv = KVCache(POOL)
    kv.reserve(tokens)
    kv.appended(list(range(tokens)))
    return kv


def shape(step):
    return [(len(s.row.tokens), s.row.num_logits) for s in step]


def test_rounds_run_whole_before_prefills_whatever_their_order():
    scheduler = Scheduler(max_tokens_per_step=64, max_rows=8)
    scheduler.add(feed(500, num_logits=0), "prefill")
    scheduler.add(feed(5, num_logits=5), "verify")
    scheduler.add(feed(1), "draft")
    step = scheduler.schedule()
    assert [s.pending.owner for s in step] == ["verify", "draft", "prefill"]
    assert shape(step) == [(5, 5), (1, 1), (58, 0)]


def test_a_long_prefill_is_chunked_and_finishes_on_its_last_chunk():
    scheduler = Scheduler(max_tokens_per_step=64, max_rows=8)
    scheduler.add(feed(150, num_logits=0), "prefill")
    finished, chunks = [], []
    while scheduler:
        step = scheduler.schedule()
        chunks.append(shape(step))
        finished += scheduler.update(step, [None] * len(step))
    assert chunks == [[(64, 0)], [(64, 0)], [(22, 0)]]
    assert finished == [("prefill", None)]


def test_running_rounds_keep_running_while_a_prompt_is_prefilled():
    scheduler = Scheduler(max_tokens_per_step=32, max_rows=8)
    scheduler.add(feed(100, num_logits=0), "new")
    for _ in range(4):
        scheduler.add(feed(5, num_logits=5), "running")
        step = scheduler.schedule()
        assert [s.pending.owner for s in step][0] == "running" and shape(step)[0] == (5, 5)
        finished = scheduler.update(step, ["logits"] * len(step))
        assert ("running", "logits") in finished


def test_a_round_that_does_not_fit_waits_for_the_next_step():
    scheduler = Scheduler(max_tokens_per_step=8, max_rows=8)
    scheduler.add(feed(5, 5), "a")
    scheduler.add(feed(5, 5), "b")
    step = scheduler.schedule()
    assert [s.pending.owner for s in step] == ["a"]
    scheduler.update(step, [None])
    assert [s.pending.owner for s in scheduler.schedule()] == ["b"]


def test_a_round_larger_than_the_budget_keeps_its_logits_tokens_in_its_last_chunk():
    scheduler = Scheduler(max_tokens_per_step=4, max_rows=8)
    scheduler.add(feed(10, num_logits=6), "big")
    chunks = []
    while scheduler:
        step = scheduler.schedule()
        chunks.append(shape(step))
        scheduler.update(step, [None] * len(step))
    assert chunks == [[(4, 0)], [(6, 6)]]


def test_rows_per_step_are_capped():
    scheduler = Scheduler(max_tokens_per_step=100, max_rows=2)
    for name in "abc":
        scheduler.add(feed(1), name)
    assert [s.pending.owner for s in scheduler.schedule()] == ["a", "b"]


def test_feeds_of_closed_sessions_are_dropped():
    scheduler = Scheduler(max_tokens_per_step=100, max_rows=8)
    closed, open_ = feed(3), feed(3)
    scheduler.add(closed, "closed")
    scheduler.add(open_, "open")
    closed.kv.free()
    assert scheduler.drop_closed() == ["closed"]
    assert [s.pending.owner for s in scheduler.schedule()] == ["open"]


def test_a_verify_that_does_not_fit_runs_a_prefix_of_its_drafts_instead_of_waiting():
    pool = BlockPool(64, 4)
    scheduler = Scheduler(max_tokens_per_step=6, max_rows=8)
    first, second = KVCache(pool), KVCache(pool)
    scheduler.add(Feed(first, [1, 2, 3], num_logits=3, trimmable=2), "first")
    scheduler.add(Feed(second, [4, 5, 6, 7, 8], num_logits=5, trimmable=4), "second")
    step = scheduler.schedule()
    # The first round whole (3 tokens), then 3 of the second's 5: x_n and 2 drafts.
    assert [(s.row.tokens, s.row.num_logits, s.finishes) for s in step] == [
        ([1, 2, 3], 3, True),
        ([4, 5, 6], 3, True),
    ]
    assert [owner for owner, _ in scheduler.update(step, ["a", "b"])] == ["first", "second"]
    assert len(scheduler) == 0


def test_a_feed_that_may_not_be_trimmed_still_waits_for_room():
    pool = BlockPool(64, 4)
    scheduler = Scheduler(max_tokens_per_step=6, max_rows=8)
    scheduler.add(Feed(KVCache(pool), [1, 2, 3], num_logits=3), "first")
    scheduler.add(Feed(KVCache(pool), [4, 5, 6, 7, 8], num_logits=5), "second")
    assert [s.pending.owner for s in scheduler.schedule()] == ["first"]


def test_only_drafts_may_be_trimmed():
    pool = BlockPool(8, 4)
    with pytest.raises(ValueError, match="trimmable"):
        Feed(KVCache(pool), [1, 2, 3], num_logits=3, trimmable=3)  # x_n must run
    with pytest.raises(ValueError, match="trimmable"):
        Feed(KVCache(pool), [1, 2, 3], num_logits=1, trimmable=1)  # a prefill chunk


def test_a_prompt_with_no_session_beside_it_runs_whole_up_to_the_prefill_limit():
    pool = BlockPool(num_blocks=1024, block_size=16)
    scheduler = Scheduler(max_tokens_per_step=64, max_rows=8, max_prefill_tokens=3000)
    for num_logits in (1, 0):  # a target's open (its first token wanted), a draft's prefill
        alone = Feed(KVCache(pool), list(range(3000)), num_logits)
        alone.kv.reserve(3000)
        scheduler.add(alone, "alone")
        step = scheduler.schedule()
        assert shape(step) == [(3000, num_logits)]
        assert scheduler.update(step, ["logits"]) == [("alone", "logits")]
        alone.kv.free()


@pytest.mark.parametrize(
    "beside", ["a session holding cache", "another feed waiting", "none", "scattered blocks"]
)
def test_a_prompt_beside_other_sessions_or_past_the_limit_is_chunked(beside):
    pool = BlockPool(num_blocks=1024, block_size=16)
    scheduler = Scheduler(max_tokens_per_step=64, max_rows=8, max_prefill_tokens=1000)
    length = 3000 if beside == "none" else 1000  # past the limit alone; within it beside others
    prompt = Feed(KVCache(pool), list(range(length)), num_logits=0)
    if beside == "scattered blocks":  # attended under a mask, whose size the budget bounds
        gone, held = KVCache(pool), KVCache(pool)
        gone.reserve(16)
        held.reserve(16)
        gone.free()
        prompt.kv.reserve(length)  # block 1, then 3 onward
        held.free()
    else:
        prompt.kv.reserve(length)
    if beside == "a session holding cache":
        KVCache(pool).reserve(10)
    if beside == "another feed waiting":
        scheduler.add(Feed(KVCache(pool), [1, 2], num_logits=0), "other")
    scheduler.add(prompt, "prompt")
    assert sum(len(s.row.tokens) for s in scheduler.schedule()) == 64


def test_a_catch_up_past_the_cuda_graphs_runs_in_chunks_they_hold():
    # A draft syncs 21 tokens committed while it drafted none; its graphs
    # hold 17 a row: 17, then the 4 whose last logits are wanted, replayed.
    scheduler = Scheduler(max_tokens_per_step=2048, max_rows=8)
    scheduler.add(Feed(cached(40), list(range(21)), num_logits=1), "sync")
    chunks = []
    while scheduler:
        step = scheduler.schedule(graphed_tokens_per_row=17)
        chunks.append(shape(step))
        scheduler.update(step, [None] * len(step))
    assert chunks == [[(17, 0)], [(4, 1)]]


@pytest.mark.parametrize("tokens, context", [(21, 0), (17, 40), (69, 40)])
def test_a_prompt_a_round_within_the_graphs_or_a_long_catch_up_runs_whole(tokens, context):
    # An opening prompt runs as a prefill does; a catch-up of more than four
    # chunks costs more replayed than in one eager step.
    scheduler = Scheduler(max_tokens_per_step=2048, max_rows=8)
    scheduler.add(Feed(cached(context), list(range(tokens)), num_logits=1), "round")
    assert shape(scheduler.schedule(graphed_tokens_per_row=17)) == [(tokens, 1)]
