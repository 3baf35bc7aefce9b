"""32 concurrent streams for two minutes against real processes: no errors,
every output identical to target-only greedy decoding, latency percentiles
and memory. The drafter is prompt lookup, in the coordinator (the chart's
default); about a third of its guesses on the tiny model are rejected, so
many rounds roll the target's cache back."""

from __future__ import annotations

import asyncio
import statistics
import time
from itertools import pairwise

import grpc
import pytest
from transformers import AutoTokenizer

from outrider.client import AsyncClient
from tests.integration.harness import reference_greedy
from tests.stress.cluster import sessions_left, start_stack
from tests.tiny import CORPUS

pytestmark = pytest.mark.stress
CONCURRENCY = 32
DURATION_S = 120.0
MAX_NEW = 32
PROMPTS = [text[:60] for text in CORPUS[:8]]


def percentiles(samples: list[float]) -> str:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return f"p50 {cuts[49] * 1000:7.1f} ms   p99 {cuts[98] * 1000:7.1f} ms   (n = {len(samples)})"


async def test_32_concurrent_streams_for_two_minutes_without_an_error(cluster, tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    references = [reference_greedy(tiny_target_dir, ids, MAX_NEW, eos=None) for ids in prompts]
    stack = await start_stack(cluster, tiny_target_dir, coordinator_args=["--prompt-lookup"])
    services = [*stack.workers, stack.coordinator]

    latencies, ttfts, gaps = [], [], []
    errors: list[str] = []
    mismatches = tokens = drafted = accepted = 0

    async def lane(client: AsyncClient, lane_index: int, until: float) -> None:
        nonlocal mismatches, tokens, drafted, accepted
        request = lane_index
        while time.monotonic() < until:
            index = request % len(prompts)
            request += CONCURRENCY
            ids, chunk_times, stats = [], [], None
            started = time.monotonic()
            try:
                async for chunk in client.stream(
                    token_ids=prompts[index],
                    max_new_tokens=MAX_NEW,
                    ignore_eos=True,
                    num_speculative_tokens=4,
                ):
                    ids.extend(chunk.token_ids)
                    chunk_times.append(time.monotonic())
                    stats = chunk.stats or stats
            except grpc.aio.AioRpcError as exc:
                errors.append(f"{exc.code().name}: {exc.details()}")
                continue
            latencies.append(chunk_times[-1] - started)
            ttfts.append(chunk_times[0] - started)
            gaps.extend(b - a for a, b in pairwise(chunk_times))
            mismatches += ids != references[index]
            tokens += len(ids)
            drafted += stats.draft_tokens
            accepted += stats.accepted_tokens

    async with AsyncClient(stack.coordinator.address, timeout=60) as client:
        await asyncio.gather(
            *(lane(client, i, time.monotonic() + 5) for i in range(CONCURRENCY))
        )  # warm-up
        latencies.clear(), ttfts.clear(), gaps.clear()
        tokens = drafted = accepted = 0
        rss_before = {s.name: s.rss_bytes() / 2**20 for s in services}
        started = time.monotonic()
        await asyncio.gather(*(lane(client, i, started + DURATION_S) for i in range(CONCURRENCY)))
        elapsed = time.monotonic() - started
        rss_after = {s.name: s.rss_bytes() / 2**20 for s in services}

    print(
        f"\nload: {CONCURRENCY} concurrent streams for {elapsed:.0f} s: {len(latencies)} requests, "
        f"{len(errors)} errors, {mismatches} outputs differing from target-only, "
        f"{tokens / elapsed:.0f} tokens/s, "
        f"acceptance rate {accepted / drafted if drafted else 0:.2f}"
    )
    print(f"  request latency    {percentiles(latencies)}")
    print(f"  time to 1st chunk  {percentiles(ttfts)}")
    print(f"  between chunks     {percentiles(gaps)}")
    for s in services:
        print(
            f"  RSS {s.name:12} {rss_before[s.name]:.1f} MiB before, "
            f"{rss_after[s.name]:.1f} MiB after"
        )
    assert elapsed >= DURATION_S
    assert errors == [], errors[:5]
    assert mismatches == 0
    assert len(latencies) >= CONCURRENCY
    assert await sessions_left(stack.workers) == {w.name: (0, 0) for w in stack.workers}
