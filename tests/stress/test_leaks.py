"""1,000 streams cancelled by the client at random points — while the
sessions open (prefill), or after a random number of chunks — leave no
session and no cached token on either worker (session lifetime = stream
lifetime, docs/design.md#protocol), and the workers' memory stops growing."""

from __future__ import annotations

import asyncio
import contextlib
import random

import grpc
import pytest

from outrider.client import AsyncClient
from tests.stress.cluster import Service, sessions_left, start_stack
from tests.stress.conftest import MAX_NEW

pytestmark = pytest.mark.stress
WARMUP = 100
BATCHES = (500, 500)
CONCURRENCY = 16
MAX_CHUNKS = 8
"""A stream is cancelled after at most this many chunks (of at most 5 tokens): none finishes."""
PLATEAU_MIB = 8.0
"""Most a worker's RSS may grow over the second batch of cancels. The first
batch may still fill allocator caches (glibc arenas, torch's CPU allocator)
and gRPC's per-connection buffers; a leak grows every batch: one leaked
session per stream (its Session object, DynamicCache and gRPC call, several
KiB even with an empty cache) would add well over 8 MiB per 500 streams."""
BASELINE_MIB = 16.0
"""Most a worker's RSS may end above its level after the warm-up."""


async def cancelled_stream(client: AsyncClient, prompt_ids, rng: random.Random) -> str:
    """One stream with a random K, cancelled at a random point: after a random
    delay (often while the sessions open and prefill), or after a random
    number of chunks. Returns where it was cancelled."""
    after = rng.randint(0, MAX_CHUNKS)
    stream = client.stream(
        token_ids=prompt_ids,
        max_new_tokens=MAX_NEW,
        ignore_eos=True,
        num_speculative_tokens=rng.choice((0, 1, 2, 4)),
    )
    chunks = 0

    async def consume():
        nonlocal chunks
        async for chunk in stream:
            assert chunk.finish_reason is None, "a stream finished before it was cancelled"
            chunks += 1
            if chunks == after:
                return

    async with contextlib.aclosing(stream):
        if after:
            await consume()
            return "mid-stream (after a chunk)"
        # Cancel the task reading it (gRPC cancels the call), at a random moment.
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(rng.uniform(0, 0.03))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return "before the first chunk" if chunks == 0 else "mid-stream (after a delay)"


async def cancel_many(address: str, prompt_ids, n: int, rng: random.Random) -> dict[str, int]:
    """``n`` streams, ``CONCURRENCY`` at a time; counts where each was
    cancelled (or what it raised)."""
    outcomes: dict[str, int] = {}
    pending = iter(range(n))
    async with AsyncClient(address, timeout=60) as client:

        async def lane():
            for _ in pending:
                try:
                    where = await cancelled_stream(client, prompt_ids, rng)
                except grpc.aio.AioRpcError as exc:
                    where = f"error {exc.code().name}: {exc.details()}"
                outcomes[where] = outcomes.get(where, 0) + 1

        await asyncio.gather(*(lane() for _ in range(CONCURRENCY)))
    return outcomes


def rss_mib(services: list[Service]) -> dict[str, float]:
    return {s.name: s.rss_bytes() / 2**20 for s in services}


async def test_1000_streams_cancelled_at_random_points_leave_no_session_and_memory_plateaus(
    cluster, tiny_target_dir, tiny_draft_same_dir, prompt_ids
):
    stack = await start_stack(cluster, tiny_target_dir, tiny_draft_same_dir)
    services = [*stack.workers, stack.coordinator]
    no_sessions = {w.name: (0, 0) for w in stack.workers}
    rng = random.Random(1000)

    await cancel_many(stack.coordinator.address, prompt_ids, WARMUP, rng)
    assert await sessions_left(stack.workers) == no_sessions
    rss = [rss_mib(services)]
    outcomes: dict[str, int] = {}
    for n in BATCHES:
        for where, count in (
            await cancel_many(stack.coordinator.address, prompt_ids, n, rng)
        ).items():
            outcomes[where] = outcomes.get(where, 0) + count
        left = await sessions_left(stack.workers)
        assert left == no_sessions, (
            f"sessions (open, cached tokens) left after {n} cancelled streams: {left}"
        )
        rss.append(rss_mib(services))

    print(
        f"\n{sum(BATCHES)} streams cancelled: {outcomes}; "
        f"sessions left (open, cached tokens): {left}"
    )
    print("RSS MiB after warm-up / first batch / second batch:")
    for s in services:
        print(f"  {s.name:12} " + " / ".join(f"{r[s.name]:.1f}" for r in rss))
    assert not [where for where in outcomes if where.startswith("error")], outcomes
    assert sum(outcomes.values()) == sum(BATCHES)
    assert (
        outcomes.get("before the first chunk", 0) > 0
        and outcomes.get("mid-stream (after a chunk)", 0) > 0
    )
    for worker in stack.workers:
        growth = rss[2][worker.name] - rss[1][worker.name]
        assert growth <= PLATEAU_MIB, (
            f"the {worker.name}'s RSS grew {growth:.1f} MiB over the second batch"
        )
        above = rss[2][worker.name] - rss[0][worker.name]
        assert above <= BASELINE_MIB, (
            f"the {worker.name}'s RSS ends {above:.1f} MiB above its level after warm-up"
        )
