"""Suffix decoding through real gRPC services on a tiny float64 target:
sessions draft from their own history and from the outputs of earlier and
concurrent sessions, and every output is still target-only greedy
decoding's, at one stream and at eight, fixed K and adaptive."""

from __future__ import annotations

import asyncio
import random

import pytest

from outrider.client import AsyncClient
from tests.integration.harness import reference_greedy, running_stack

NO_EOS = -1
VOCAB = 512


def agentic_turns(count: int, *, seed: int, max_new: int, target_dir) -> list[list[int]]:
    """Prompts like an agent's: a task, then later turns that resend an
    earlier turn's output with a short instruction around it."""
    rng = random.Random(seed)
    tasks = [[rng.randrange(3, VOCAB) for _ in range(12)] for _ in range(count)]
    turns = []
    for task in tasks:
        answer = reference_greedy(target_dir, task, max_new, eos=None)
        turns.append(task)
        turns.append([*rng.sample(range(3, VOCAB), 4), *answer, *rng.sample(range(3, VOCAB), 3)])
    return turns


async def tasks_then_turns(stack, prompts, streams: int, max_new: int, speculation: dict):
    """Generates every task first (their outputs fill the shared cache),
    then the turns that resend them, ``streams`` at a time."""
    async with AsyncClient(stack.address, timeout=120) as client:
        semaphore = asyncio.Semaphore(streams)

        async def generate(prompt):
            async with semaphore:
                return await client.generate(
                    token_ids=prompt, max_new_tokens=max_new, **speculation
                )

        first = await asyncio.gather(*(generate(p) for p in prompts[0::2]))
        later = await asyncio.gather(*(generate(p) for p in prompts[1::2]))
    return first, later


@pytest.mark.parametrize("streams", [1, 8])
@pytest.mark.parametrize("speculation", [dict(num_speculative_tokens=4), dict(adaptive=True)])
async def test_suffix_drafts_give_the_target_only_output_and_come_from_earlier_outputs(
    tiny_target_dir, streams, speculation
):
    max_new = 40
    prompts = agentic_turns(4, seed=streams, max_new=max_new, target_dir=tiny_target_dir)
    references = [reference_greedy(tiny_target_dir, p, max_new, eos=None) for p in prompts]
    async with running_stack(tiny_target_dir, drafter="suffix", eos_token_ids={NO_EOS}) as stack:
        first, later = await tasks_then_turns(stack, prompts, streams, max_new, speculation)
        cache = stack.coordinator.draft.cache
        assert await stack.sessions_left() == (0, 0)
    results = [r for pair in zip(first, later, strict=True) for r in pair]
    assert [list(r.token_ids) for r in results] == references
    assert cache.hits > 0 and cache.tokens == sum(len(r.token_ids) for r in results)
    assert sum(r.stats.accepted_tokens for r in later) > 0


async def test_concurrent_sessions_share_the_cache_as_they_generate(tiny_target_dir):
    """Eight sessions on one prompt, each starting a little after the one
    before while it still runs: each drafts from what those before it have
    committed so far."""
    prompt = [7, 8, 9, 10, 11, 12]
    reference = reference_greedy(tiny_target_dir, prompt, 48, eos=None)
    async with running_stack(tiny_target_dir, drafter="suffix", eos_token_ids={NO_EOS}) as stack:
        async with AsyncClient(stack.address, timeout=120) as client:

            async def session(i: int):
                await asyncio.sleep(0.05 * i)
                return await client.generate(
                    token_ids=prompt, max_new_tokens=48, num_speculative_tokens=6
                )

            results = await asyncio.gather(*(session(i) for i in range(8)))
        cache = stack.coordinator.draft.cache
    assert all(list(r.token_ids) == reference for r in results)
    assert cache.hits > 0
    assert sum(r.stats.accepted_tokens for r in results) > 0


@pytest.mark.parametrize("streams", [1, 8])
@pytest.mark.parametrize("speculation", [dict(num_speculative_tokens=4), dict(adaptive=True)])
async def test_suffix_drafts_beside_a_draft_model_give_the_target_only_output(
    tiny_target_dir, tiny_draft_other_dir, streams, speculation
):
    """Suffix decoding beside a draft model: rounds whose suffix offer pays
    draft it, the others (no match, or a weak one) ask the draft model —
    whose cache then catches up on the tokens it did not draft. Both kinds
    of round run, and the output is target-only greedy decoding's."""
    max_new = 40
    prompts = agentic_turns(4, seed=10 + streams, max_new=max_new, target_dir=tiny_target_dir)
    references = [reference_greedy(tiny_target_dir, p, max_new, eos=None) for p in prompts]
    async with running_stack(
        tiny_target_dir,
        drafter="suffix+model",
        draft_dir=tiny_draft_other_dir,
        eos_token_ids={NO_EOS},
    ) as stack:
        first, later = await tasks_then_turns(stack, prompts, streams, max_new, speculation)
        acceptance = stack.coordinator.costs.acceptance
        cache = stack.coordinator.lookup.cache
        assert await stack.sessions_left() == (0, 0)
    results = [r for pair in zip(first, later, strict=True) for r in pair]
    assert [list(r.token_ids) for r in results] == references
    assert cache.hits > 0
    assert acceptance.judged_on_evidence > 0, "no round drafted by suffix decoding"
    assert acceptance.judged > 0, "no round drafted by the draft model"
