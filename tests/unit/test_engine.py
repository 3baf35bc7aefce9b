"""The engine inside a worker: the Llama-family forward equals transformers',
sessions' feeds share forward passes, and closes, failures and a full pool
touch only the jobs they concern."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from outrider.engine import Engine, Feed, InlineEngine
from outrider.engine.kv_cache import BlockPool, KVCache
from outrider.engine.llama import LlamaForward, unsupported
from outrider.engine.runner import PagedRunner
from outrider.engine.scheduler import Row
from outrider.errors import ResourceExhausted, SessionNotFound

SHAPE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
ARCHITECTURES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "qwen2 (q/k/v biases)": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE)),
    "qwen3 (q/k norms, head_dim 24)": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=24)),
    "mistral (sliding window 7)": lambda: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=7)),
}


def tiny(name: str = "llama", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ARCHITECTURES[name]().to(torch.float64).eval()


@pytest.fixture(scope="module")
def llama():
    return tiny()


def paged(model, *, blocks: int = 64, block_size: int = 4) -> PagedRunner:
    return PagedRunner(LlamaForward(copy.deepcopy(model)), BlockPool(blocks, block_size))


@pytest.mark.parametrize("pad_groups", [False, True], ids=["exact groups (CPU)", "padded groups (CUDA)"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_paged_forward_equals_transformers_on_chunked_ragged_batches(name, pad_groups):
    model = tiny(name)
    torch.manual_seed(1)
    sequences = [torch.randint(0, 97, (n,)).tolist() for n in (5, 6, 9, 23, 40)]
    with torch.inference_mode():
        expected = [model(torch.tensor([s])).logits[0] for s in sequences]
        runner = paged(model)
        runner.pad_groups = pad_groups
        caches = [runner.new_kv() for _ in sequences]
        cuts = (3, 3, 4, 10, 17)  # step 1: a chunk of each; step 2: the rest, with every logit
        for kv, s in zip(caches, sequences):
            kv.reserve(len(s))
        runner.execute([Row(kv, s[:c], 0) for kv, s, c in zip(caches, sequences, cuts)])
        outputs = runner.execute([Row(kv, s[c:], len(s) - c) for kv, s, c in zip(caches, sequences, cuts)])
    for out, logits, cut in zip(outputs, expected, cuts):
        torch.testing.assert_close(out.rows, logits[cut:], rtol=0, atol=1e-12)
        assert out.argmax == logits[cut:].argmax(-1).tolist()


def test_other_architectures_are_named_for_the_fallback():
    from transformers import GPT2Config, GPT2LMHeadModel

    reason = unsupported(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)))
    assert reason is not None and "gpt2" in reason


def test_rollback_in_one_session_never_touches_another(llama):
    runner = paged(llama, block_size=2)
    a, b = runner.new_kv(), runner.new_kv()
    with torch.inference_mode():
        for kv in (a, b):
            kv.reserve(12)
        runner.execute([Row(a, [1, 2, 3, 4, 5], 0), Row(b, [9, 8, 7], 0)])
        before = runner.execute([Row(b, [6], 1)])[0].rows.clone()
        b.crop(3)
        # a speculates, is rolled back into b's old blocks' neighbourhood, and speculates again
        runner.execute([Row(a, [60, 61, 62], 3)])
        a.crop(5)
        a.reserve(7)  # the engine reserves before every feed
        runner.execute([Row(a, [70, 71], 2)])
        after = runner.execute([Row(b, [6], 1)])[0].rows
        fresh = llama(torch.tensor([[9, 8, 7, 6]])).logits[0, -1:]
    assert torch.equal(before, after)
    torch.testing.assert_close(after, fresh, rtol=0, atol=1e-12)


# --- the loop -----------------------------------------------------------------------


class Spy:
    """A runner that records the rows of every step."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.steps: list[list[int]] = []
        self.fail_next = False

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, rows):
        self.steps.append([len(row.tokens) for row in rows])
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        return self.runner.execute(rows)


def greedy(kv: KVCache, prompt: list[int], n: int):
    """A job: prefill ``prompt`` and decode ``n`` tokens greedily."""
    out = yield Feed(kv, prompt, num_logits=1)
    tokens = []
    while True:
        tokens.append(out.argmax[-1])
        if len(tokens) == n:
            return tokens
        out = yield Feed(kv, [tokens[-1]])


def solo(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


async def test_sessions_starting_and_ending_at_different_times_share_steps_and_get_their_solo_tokens(llama):
    spy = Spy(paged(llama, blocks=256))
    engine = Engine(spy, max_tokens_per_step=64, max_rows=16)
    prompts = [[5, 6, 7], list(range(10, 40)), [3], [8, 9, 10, 11, 12, 13], list(range(1, 20))]
    lengths = [60, 40, 70, 50, 45]  # long enough to overlap however slowly the machine runs the sleeps

    async def session(i: int) -> list[int]:
        await asyncio.sleep(0.01 * i)  # joins mid-flight
        return await engine.run(greedy, spy.new_kv(), prompts[i], lengths[i])

    try:
        results = await asyncio.gather(*(session(i) for i in range(len(prompts))))
    finally:
        engine.shutdown()
    for prompt, n, tokens in zip(prompts, lengths, results):
        assert tokens == solo(llama, prompt, n)
    assert max(len(rows) for rows in spy.steps) >= 3  # decode steps of several sessions in one pass
    assert len(spy.steps) < sum(lengths)


async def test_a_session_closed_while_its_job_waits_ends_that_job_only(llama):
    spy = Spy(paged(llama))
    engine = Engine(spy, max_tokens_per_step=64, max_rows=8)
    doomed, kept = spy.new_kv(), spy.new_kv()

    def close_then_feed():
        doomed.free()  # the session closes between steps ...
        yield Feed(kept, [1, 2, 3])  # ... while another job's feed goes on
        return "kept"

    try:
        long_job = asyncio.ensure_future(engine.run(greedy, doomed, [1, 2], 500))
        await asyncio.sleep(0.05)
        assert await engine.run(close_then_feed) == "kept"
        with pytest.raises(SessionNotFound):
            await long_job
        assert spy.pool.free_blocks == spy.pool.num_blocks - len(kept.blocks)
    finally:
        engine.shutdown()


async def test_a_failed_step_fails_its_jobs_and_the_engine_goes_on(llama):
    spy = Spy(paged(llama))
    engine = Engine(spy, max_tokens_per_step=64, max_rows=8)
    try:
        spy.fail_next = True
        with pytest.raises(RuntimeError, match="boom"):
            await engine.run(greedy, spy.new_kv(), [1, 2, 3], 3)
        assert await engine.run(greedy, spy.new_kv(), [1, 2, 3], 3) == solo(llama, [1, 2, 3], 3)
    finally:
        engine.shutdown()


async def test_a_full_pool_is_thrown_into_the_job_that_asked():
    engine = InlineEngine(paged(tiny(), blocks=2, block_size=4))
    with pytest.raises(ResourceExhausted, match="cache is full"):
        await engine.run(greedy, engine.runner.new_kv(), list(range(9)), 1)

    def retries_shorter(kv):
        try:
            yield Feed(kv, list(range(9)))
        except ResourceExhausted:
            out = yield Feed(kv, list(range(8)))
            return len(out.argmax)

    assert await engine.run(retries_shorter, engine.runner.new_kv()) == 1
