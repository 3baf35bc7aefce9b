"""Prefix caching through real gRPC services on tiny float64 models: sessions
that share a system prompt, and conversations whose every turn resends the
history, reuse the blocks earlier sessions sealed on both workers — and
every output is still target-only greedy decoding's, with the cache on and
off, at one stream and at eight, whatever the drafter; recovery reopens a
session on a replica with or without its prefix; a pool full of cached
blocks evicts them instead of refusing."""

from __future__ import annotations

import asyncio
import random

import pytest

from outrider.client import AsyncClient
from outrider.config import EngineConfig, Recovery, WorkerLimits
from tests.integration.harness import reference_greedy, running_stack

NO_EOS = -1
VOCAB = 512
ON = EngineConfig(dtype="float64", threads=1)
OFF = EngineConfig(dtype="float64", threads=1, enable_prefix_caching=False)


def shared_prefix_prompts(count: int, *, seed: int) -> list[list[int]]:
    """``count`` prompts over 3 system prompts of 40 to 60 tokens (2 or 3
    full blocks), each followed by a question of its own."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(40, 60))] for _ in range(3)]
    return [
        [*systems[i % 3], *(rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12)))]
        for i in range(count)
    ]


def prefix_hits(stack, worker: str) -> float:
    return stack.metrics[worker].registry.get_sample_value("outrider_prefix_cache_hits_total")


# (drafter, speculation): K = 0; a model drafter that is mostly rejected,
# adaptive; int4 of the target, adaptive; prompt lookup, adaptive.
DRAFTERS = [
    (None, dict(num_speculative_tokens=0)),
    ("model", dict(num_speculative_tokens=4, adaptive=True)),
    ("int4", dict(num_speculative_tokens=4, adaptive=True)),
    ("prompt-lookup", dict(num_speculative_tokens=4, adaptive=True)),
]


@pytest.mark.parametrize("streams", [1, 8])
@pytest.mark.parametrize(("drafter", "speculation"), DRAFTERS, ids=[d or "k0" for d, _ in DRAFTERS])
async def test_outputs_equal_target_only_with_the_cache_on_and_off(
    tiny_target_dir, tiny_draft_other_dir, drafter, speculation, streams
):
    """Two waves of 8 sessions on shared system prompts, then each
    session's second turn (its prompt, its answer, a new question): the
    second wave and the turns find their prefixes cached, and rounds roll
    back drafts in the blocks right after the shared ones."""
    prompts = shared_prefix_prompts(16, seed=streams)
    max_new = 20
    references = [reference_greedy(tiny_target_dir, p, max_new, eos=None) for p in prompts]
    rng = random.Random(7)
    turns = [
        [*p, *ref, *(rng.randrange(3, VOCAB) for _ in range(5))]
        for p, ref in zip(prompts[:8], references, strict=False)
    ]
    turn_references = [reference_greedy(tiny_target_dir, t, max_new, eos=None) for t in turns]
    outputs = {}
    for engine in (ON, OFF):
        async with running_stack(
            tiny_target_dir,
            drafter=drafter,
            draft_dir=tiny_draft_other_dir if drafter == "model" else None,
            eos_token_ids={NO_EOS},
            engine=engine,
            metrics=True,
        ) as stack:
            async with AsyncClient(stack.address, timeout=120) as client:
                semaphore = asyncio.Semaphore(streams)

                async def generate(tokens, semaphore=semaphore, client=client):
                    async with semaphore:
                        return await client.generate(
                            token_ids=tokens, max_new_tokens=max_new, **speculation
                        )

                first = await asyncio.gather(*(generate(p) for p in prompts[:8]))
                second = await asyncio.gather(*(generate(p) for p in prompts[8:]))
                third = await asyncio.gather(*(generate(t) for t in turns))
            results = [*first, *second, *third]
            outputs[engine.enable_prefix_caching] = [list(r.token_ids) for r in results]
            cached = [r.stats.cached_prompt_tokens for r in results]
            if engine is ON:
                assert all(c > 0 for c in cached[8:]), cached  # every later prompt found some
                assert all(c >= len(p) - 16 for c, p in zip(cached[16:], prompts, strict=False))
                if stack.draft is not None:
                    assert prefix_hits(stack, "draft") > 0
            else:
                assert cached == [0] * len(results)
            if drafter not in (None, "prompt-lookup"):
                assert any(r.stats.draft_tokens > r.stats.accepted_tokens for r in results)
            assert await stack.sessions_left() == (0, 0)
            assert stack.target.store.pool.used_blocks == 0  # cached blocks are free blocks
    assert outputs[None] == outputs[False] == [*references, *turn_references]


@pytest.mark.parametrize("prefix_on_survivor", [True, False], ids=["with", "without"])
async def test_recovery_reopens_on_a_replica_with_or_without_the_prefix(
    tiny_target_dir, tiny_draft_other_dir, prefix_on_survivor
):
    (prompt,) = shared_prefix_prompts(1, seed=3)
    max_new = 120
    reference = reference_greedy(tiny_target_dir, prompt, max_new, eos=None)
    recovery = Recovery(draft_deadline_s=2.0, draft_backoff_s=0.05, target_attempts=3)
    async with running_stack(
        tiny_target_dir,
        draft_dir=tiny_draft_other_dir,
        eos_token_ids={NO_EOS},
        target_replicas=2,
        recovery=recovery,
        metrics=True,
    ) as stack:
        async with AsyncClient(stack.address, timeout=60) as client:
            if prefix_on_survivor:  # three at once: the load bound spills one to the other replica
                await asyncio.gather(
                    *(client.generate(token_ids=prompt, max_new_tokens=4) for _ in range(3))
                )
                assert all(t.store.pool.cached_blocks for t in stack.targets)
            hits = [prefix_hits(stack, name) for name in ("target", "target-1")]
            ids, killed = [], None
            async for chunk in client.stream(
                token_ids=prompt, max_new_tokens=max_new, num_speculative_tokens=3
            ):
                ids.extend(chunk.token_ids)
                if killed is None:
                    (killed,) = [i for i, t in enumerate(stack.targets) if len(t.store)]
                    await stack.target_servers[killed].stop(None)
        assert ids == reference
        survivor = 1 - killed
        found = prefix_hits(stack, ("target", "target-1")[survivor]) - hits[survivor]
        if prefix_on_survivor:
            assert found >= len(prompt) // 16 * 16  # the reopen found the prompt's blocks
        else:
            assert found == 0
        assert await stack.sessions_left() == (0, 0)


async def test_a_pool_full_of_cached_blocks_evicts_them_and_refuses_nothing(
    tiny_target_dir, tiny_draft_other_dir
):
    """A pool of 24 blocks (384 tokens): 12 sessions on distinct 100-token
    prompts one after another, then 3 at once (all the pool holds), each
    needing blocks that cached ones fill."""
    prompts = [shared_prefix_prompts(1, seed=100 + i)[0] * 2 for i in range(15)]
    async with running_stack(
        tiny_target_dir,
        draft_dir=tiny_draft_other_dir,
        eos_token_ids={NO_EOS},
        limits=WorkerLimits(max_cached_tokens=384, max_sessions=4),
    ) as stack:
        pool = stack.target.store.pool
        async with AsyncClient(stack.address, timeout=60) as client:
            for prompt in prompts[:12]:
                await client.generate(token_ids=prompt[:100], max_new_tokens=8)
            assert pool.cached_blocks > pool.num_blocks // 2  # kept after their sessions
            results = await asyncio.gather(
                *(client.generate(token_ids=p[:100], max_new_tokens=8) for p in prompts[12:])
            )
        assert all(len(r.token_ids) == 8 for r in results)
        assert pool.cached_blocks <= pool.num_blocks
        assert await stack.sessions_left() == (0, 0)
