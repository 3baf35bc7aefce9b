"""Worker loss mid-stream: the coordinator's history is the truth, so the
stream survives a dead draft (K = 0, then reopened) and a dead target replica
(reopened on another), with output identical to target-only decoding."""

import asyncio

import grpc
import pytest

from coordinator.loop import Recovery
from outrider.client import AsyncClient
from outrider.rpc import start_server
from outrider.v1 import worker_pb2_grpc
from draft_worker.service import DraftWorkerService
from tests.integration.harness import reference_greedy, running_stack

NO_EOS = -1
MAX_NEW = 300
FAST = Recovery(draft_deadline_s=2.0, draft_backoff_s=0.05, target_attempts=3)


@pytest.fixture(scope="module")
def prompt_ids(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)("Once upon a time there was a fox")["input_ids"]


@pytest.fixture(scope="module")
def reference(tiny_target_dir, prompt_ids):
    return reference_greedy(tiny_target_dir, prompt_ids, MAX_NEW, eos=None)


async def stream_and_then(address, prompt_ids, action, **kwargs):
    """Streams a generation, running ``action`` after the first chunk."""
    async with AsyncClient(address, timeout=60) as client:
        chunks = []
        async for chunk in client.stream(token_ids=prompt_ids, max_new_tokens=MAX_NEW, **kwargs):
            if not chunks:
                await action()
            chunks.append(chunk)
    return [t for c in chunks for t in c.token_ids], chunks[-1].stats


async def test_draft_killed_mid_stream_the_stream_finishes_at_k0(
    tiny_target_dir, tiny_draft_same_dir, prompt_ids, reference
):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_same_dir, eos_token_ids={NO_EOS}, recovery=FAST
    ) as stack:
        ids, stats = await stream_and_then(
            stack.address, prompt_ids, lambda: stack.draft_server.stop(None), num_speculative_tokens=4
        )
        assert ids == reference
        # The draft died early: most rounds were target-only.
        assert stats.draft_tokens < stats.rounds * 4 / 2
        assert await stack.sessions_left() == (0, 0)


async def test_a_restarted_draft_is_used_again(tiny_target_dir, tiny_draft_same_dir, prompt_ids, reference):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_same_dir, eos_token_ids={NO_EOS}, recovery=FAST
    ) as stack:
        port = stack.draft_server.port
        await stack.draft_server.stop(None)
        async with AsyncClient(stack.address, timeout=60) as client:
            down = await client.generate(token_ids=prompt_ids, max_new_tokens=20, num_speculative_tokens=4)
            assert list(down.token_ids) == reference[:20] and down.stats.draft_tokens == 0

            sessions, engine = stack.draft, stack.draft_engine
            restarted = await start_server(
                lambda s: worker_pb2_grpc.add_DraftWorkerServicer_to_server(
                    DraftWorkerService(sessions, engine, idle_timeout_s=60.0), s
                ),
                ["outrider.v1.DraftWorker"],
                port=port,
            )
            await restarted.set_serving(True)
            try:
                for _ in range(20):  # the channel reconnects within its back-off (<= 2 s)
                    up = await client.generate(token_ids=prompt_ids, max_new_tokens=20, num_speculative_tokens=4)
                    if up.stats.draft_tokens:
                        break
                    await asyncio.sleep(0.25)
            finally:
                await restarted.stop(None)
    assert list(up.token_ids) == reference[:20]
    assert up.stats.draft_tokens > 0 and up.stats.acceptance_rate == 1.0


async def test_target_replica_killed_mid_stream_the_stream_finishes_on_the_other(
    tiny_target_dir, tiny_draft_other_dir, prompt_ids, reference
):
    async with running_stack(
        tiny_target_dir,
        draft_dir=tiny_draft_other_dir,
        eos_token_ids={NO_EOS},
        target_replicas=2,
        recovery=FAST,
    ) as stack:

        async def kill_the_busy_target():
            (busy,) = [i for i, engine in enumerate(stack.targets) if len(engine.store)]
            await stack.target_servers[busy].stop(None)
            kill_the_busy_target.index = busy

        ids, stats = await stream_and_then(stack.address, prompt_ids, kill_the_busy_target, num_speculative_tokens=3)
        assert ids == reference
        survivor = stack.targets[1 - kill_the_busy_target.index]
        assert await stack.sessions_left() == (0, 0)
        assert survivor.store.cached_tokens == 0


async def test_no_target_left_ends_the_stream_unavailable(tiny_target_dir, prompt_ids):
    async with running_stack(
        tiny_target_dir, drafter="prompt-lookup", eos_token_ids={NO_EOS}, recovery=FAST
    ) as stack:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(
                stream_and_then(stack.address, prompt_ids, lambda: stack.target_servers[0].stop(None)),
                timeout=30,
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "target" in info.value.details()
