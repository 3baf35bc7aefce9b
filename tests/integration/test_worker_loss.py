"""Worker loss mid-stream: the coordinator's history is the truth, so the
stream survives a dead draft (K = 0, then reopened) — pipelined, with a
speculation in flight, too — and a dead or frozen target replica (reopened on
another, a frozen one within the verify deadline), with output identical to
target-only decoding; a stream cancelled mid-speculation frees every session."""

import asyncio
import contextlib
import threading
import time
from itertools import pairwise

import grpc
import pytest

from outrider.client import AsyncClient
from outrider.config import Recovery
from outrider.coordinator.workers.draft_link import DraftLink
from outrider.draft_worker.service import DraftWorkerService
from outrider.rpc import start_server
from outrider.v1 import worker_pb2_grpc
from tests.integration.harness import reference_greedy, running_stack

NO_EOS = -1
MAX_NEW = 300
FAST = Recovery(draft_deadline_s=2.0, draft_backoff_s=0.05, target_attempts=3)


@pytest.fixture(scope="module")
def prompt_ids(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)("Once upon a time there was a fox")[
        "input_ids"
    ]


@pytest.fixture(scope="module")
def reference(tiny_target_dir, prompt_ids):
    return reference_greedy(tiny_target_dir, prompt_ids, MAX_NEW, eos=None)


async def stream_and_then(
    address, prompt_ids, action, *, at: int = 1, times: list[float] | None = None, **kwargs
):
    """Streams a generation, running ``action`` once chunk number ``at``
    (from 1) has arrived; ``times`` gets each chunk's arrival (monotonic)."""
    async with AsyncClient(address, timeout=60) as client:
        chunks = []
        async for chunk in client.stream(token_ids=prompt_ids, max_new_tokens=MAX_NEW, **kwargs):
            if times is not None:
                times.append(time.monotonic())
            if len(chunks) + 1 == at:
                await action()
            chunks.append(chunk)
    return [t for c in chunks for t in c.token_ids], chunks[-1].stats


async def nothing() -> None:
    pass


async def test_draft_killed_mid_stream_the_stream_finishes_at_k0(
    tiny_target_dir, tiny_draft_same_dir, prompt_ids, reference
):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_same_dir, eos_token_ids={NO_EOS}, recovery=FAST
    ) as stack:
        ids, stats = await stream_and_then(
            stack.address,
            prompt_ids,
            lambda: stack.draft_server.stop(None),
            num_speculative_tokens=4,
        )
        assert ids == reference
        # The draft died early: most rounds were target-only.
        assert stats.draft_tokens < stats.rounds * 4 / 2
        assert await stack.sessions_left() == (0, 0)


async def test_draft_killed_mid_speculation_the_pipelined_stream_finishes_at_k0_identical(
    tiny_target_dir, tiny_draft_same_dir, prompt_ids, reference
):
    # A draft step of 20 ms: a speculation (K + 1 steps) outlasts the
    # verify it overlaps, so one is in flight whenever a chunk arrives.
    async with running_stack(
        tiny_target_dir,
        draft_dir=tiny_draft_same_dir,
        eos_token_ids={NO_EOS},
        recovery=FAST,
        step_s={"draft": 0.02},
    ) as stack:
        ids, stats = await stream_and_then(
            stack.address,
            prompt_ids,
            lambda: stack.draft_server.stop(None),
            at=5,
            num_speculative_tokens=4,
            pipeline=True,
        )
        assert ids == reference
        assert stats.pipeline
        # Rounds 3-5 were drafted while the round before was verified (the
        # first chunk is the prefill's token; the draft died for good at the
        # 5th chunk: no hit came after it).
        assert stats.speculation_hits >= 3
        # The speculation in flight at the kill failed: a miss, then K = 0.
        assert stats.speculation_misses >= 1
        assert stats.draft_tokens < stats.rounds * 4 / 2
        assert await stack.sessions_left() == (0, 0)


async def test_streams_cancelled_mid_speculation_leave_no_session(
    tiny_target_dir, tiny_draft_same_dir, prompt_ids, monkeypatch
):
    speculations: list[asyncio.Future] = []
    speculate = DraftLink.speculate

    def recording_speculate(self, history, drafts, k):
        speculate(self, history, drafts, k)
        if self.speculation is not None and self.speculation.task not in speculations:
            speculations.append(self.speculation.task)

    monkeypatch.setattr(DraftLink, "speculate", recording_speculate)
    cancel_after = (2, 3, 4, 6, 9)  # (the first chunk is the prefill's token: no speculation yet)
    # A draft step of 30 ms: a speculation (K + 1 steps) outlasts the
    # verify it overlaps, so one is in flight whenever a chunk arrives.
    async with running_stack(
        tiny_target_dir,
        draft_dir=tiny_draft_same_dir,
        eos_token_ids={NO_EOS},
        recovery=FAST,
        step_s={"draft": 0.03},
    ) as stack:
        async with AsyncClient(stack.address, timeout=60) as client:

            async def cancelled_after(n: int) -> int:
                stream = client.stream(
                    token_ids=prompt_ids,
                    max_new_tokens=MAX_NEW,
                    num_speculative_tokens=4,
                    pipeline=True,
                )
                async with contextlib.aclosing(stream):  # closing it cancels the call
                    chunks = 0
                    async for chunk in stream:
                        assert chunk.finish_reason is None
                        chunks += 1
                        if chunks == n:
                            break
                return chunks

            assert await asyncio.gather(*(cancelled_after(n) for n in cancel_after)) == list(
                cancel_after
            )
        assert await stack.sessions_left() == (0, 0)
    # Each stream's last speculation was cut short by the cancellation.
    assert sum(task.cancelled() for task in speculations) == len(cancel_after)


async def test_a_restarted_draft_is_used_again(
    tiny_target_dir, tiny_draft_same_dir, prompt_ids, reference
):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_same_dir, eos_token_ids={NO_EOS}, recovery=FAST
    ) as stack:
        port = stack.draft_server.port
        await stack.draft_server.stop(None)
        async with AsyncClient(stack.address, timeout=60) as client:
            down = await client.generate(
                token_ids=prompt_ids, max_new_tokens=20, num_speculative_tokens=4
            )
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
                    up = await client.generate(
                        token_ids=prompt_ids, max_new_tokens=20, num_speculative_tokens=4
                    )
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

        ids, _ = await stream_and_then(
            stack.address, prompt_ids, kill_the_busy_target, num_speculative_tokens=3
        )
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
                stream_and_then(
                    stack.address, prompt_ids, lambda: stack.target_servers[0].stop(None)
                ),
                timeout=30,
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "target" in info.value.details()


@pytest.mark.parametrize("pipeline", [False, True], ids=["synchronous", "pipelined"])
async def test_target_replica_frozen_mid_stream_finishes_on_the_other_within_the_verify_deadline(
    tiny_target_dir, tiny_draft_same_dir, prompt_ids, reference, pipeline
):
    recovery = Recovery(
        draft_deadline_s=2.0, draft_backoff_s=0.05, target_attempts=3, verify_deadline_floor_s=0.5
    )
    async with running_stack(
        tiny_target_dir,
        draft_dir=tiny_draft_same_dir,
        eos_token_ids={NO_EOS},
        target_replicas=2,
        recovery=recovery,
    ) as stack:
        # Unfrozen first: how long the rest of the stream takes, and what a verify costs.
        at, unfrozen_times = 5, []
        ids, stats = await stream_and_then(
            stack.address,
            prompt_ids,
            nothing,
            at=at,
            times=unfrozen_times,
            num_speculative_tokens=4,
            pipeline=pipeline,
        )
        assert ids == reference
        rest_s = unfrozen_times[-1] - unfrozen_times[at - 1]
        deadline_s = recovery.verify_deadline_s(stats.verify_time_s / stats.rounds)
        assert await stack.sessions_left() == (0, 0)

        # The busy replica's engine stalls (a frozen worker whose gRPC server
        # still answers): its next verify never gives a verdict until thawed.
        thaw, frozen = threading.Event(), []

        async def freeze_the_busy_target():
            (busy,) = [i for i, sessions in enumerate(stack.targets) if len(sessions.store)]
            sessions = stack.targets[busy]
            verify = sessions.verify

            def stalled_verify(*args):
                thaw.wait()  # on the engine thread
                return verify(*args)

            sessions.verify = stalled_verify
            frozen.append((busy, time.monotonic()))

        times = []
        try:
            ids, stats = await asyncio.wait_for(
                stream_and_then(
                    stack.address,
                    prompt_ids,
                    freeze_the_busy_target,
                    at=at,
                    times=times,
                    num_speculative_tokens=4,
                    pipeline=pipeline,
                ),
                30,
            )
        finally:
            thaw.set()
        ((busy, frozen_at),) = frozen
        del stack.targets[busy].verify
        assert ids == reference
        assert stats.pipeline == pipeline
        stall_s = max(b - a for a, b in pairwise([frozen_at, *times[at:]]))
        frozen_to_done_s = times[-1] - frozen_at
        assert stall_s <= deadline_s + 1.0
        # The rest of the stream may run up to twice as slow on a shared machine.
        assert frozen_to_done_s <= deadline_s + 1.0 + 2 * rest_s, (
            frozen_to_done_s,
            deadline_s,
            rest_s,
        )
        # The frozen replica frees its session once thawed (its stream was cancelled).
        assert await stack.sessions_left() == (0, 0)
    print(
        f"\ntarget frozen mid-stream ({'pipelined' if pipeline else 'synchronous'}, "
        f"verify deadline {deadline_s:.2f} s): longest stall {stall_s:.2f} s, "
        f"done {frozen_to_done_s:.2f} s after the freeze "
        f"(the rest of an unfrozen stream: {rest_s:.2f} s)"
    )


async def test_a_busy_target_is_waited_for_and_never_declared_lost(
    tiny_target_dir, prompt_ids, reference, monkeypatch
):
    # Every target step takes 0.3 s, longer than the verify deadline (0.2 s)
    # and than the open deadline once a prefill is measured: a worker whose
    # engine keeps stepping is busy, not frozen, so its sessions are waited
    # for — never reopened (with one attempt, a reopen would fail the request).
    from outrider.target_worker.sessions import TargetSessions

    opened = []
    open_session = TargetSessions.open

    def counting_open(self, session_id, *args):
        if session_id != "warmup":
            opened.append(session_id)
        return open_session(self, session_id, *args)

    monkeypatch.setattr(TargetSessions, "open", counting_open)
    busy = Recovery(verify_deadline_floor_s=0.2, verify_deadline_factor=0.5, target_attempts=1)
    async with running_stack(
        tiny_target_dir, drafter=None, k=0, eos_token_ids=set(), recovery=busy,
        step_s={"target": 0.3},
    ) as stack:  # fmt: skip
        async with AsyncClient(stack.address, timeout=60) as client:
            results = await asyncio.gather(
                *(client.generate(token_ids=prompt_ids, max_new_tokens=6) for _ in range(4))
            )
    assert all(list(result.token_ids) == reference[:6] for result in results)
    assert len(opened) == 4
