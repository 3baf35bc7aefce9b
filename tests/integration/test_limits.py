"""Resource bounds and bad input at the edges the fuzz test does not aim at:
idle sessions, deadlines mid-stream, oversized messages, request ids."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from outrider import errors
from outrider.client import AsyncClient
from outrider.config import WorkerLimits
from outrider.rpc import MAX_MESSAGE_BYTES, REQUEST_ID_KEY, error_from_status
from outrider.v1 import coordinator_pb2 as cpb
from outrider.v1 import coordinator_pb2_grpc, worker_pb2_grpc
from outrider.v1 import worker_pb2 as wpb
from tests.integration.harness import running_stack

NO_EOS = -1
PROMPT = [5, 17, 42, 99, 7, 300, 12]


async def final_status(call) -> tuple[grpc.StatusCode, str]:
    """Reads a session stream to its end; its status code and details."""
    try:
        while await asyncio.wait_for(call.read(), 10) is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError:
        pass
    return await call.code(), await call.details()


async def test_an_idle_session_is_closed_with_aborted_and_its_kv_freed(tiny_target_dir):
    limits = WorkerLimits(session_idle_timeout_s=0.3)
    async with running_stack(tiny_target_dir, drafter="model", limits=limits) as stack:
        async with grpc.aio.insecure_channel(stack.target_servers[0].address) as channel:
            call = worker_pb2_grpc.TargetWorkerStub(channel).Session()
            await call.write(wpb.VerifyRequest(open=wpb.SessionOpen(token_ids=PROMPT)))
            opened = await call.read()
            assert opened.opened.committed_len == len(PROMPT)
            assert (
                len(stack.target.store) == 1 and stack.target.store.cached_tokens == len(PROMPT) - 1
            )
            # No message for longer than the timeout: the worker ends the stream.
            code, details = await final_status(call)
            assert code == grpc.StatusCode.ABORTED and "idle for 0.3 s" in details
        assert await stack.sessions_left() == (0, 0)
        assert stack.target.store.cached_tokens == 0


async def test_an_active_session_outlives_the_idle_timeout(tiny_target_dir):
    limits = WorkerLimits(session_idle_timeout_s=0.25)
    async with running_stack(
        tiny_target_dir, drafter="model", limits=limits, eos_token_ids={NO_EOS}
    ) as stack:
        async with AsyncClient(stack.address) as client:
            # Rounds keep coming, so a generation longer than the timeout finishes.
            result = await client.generate(
                token_ids=PROMPT, max_new_tokens=480, num_speculative_tokens=1
            )
        assert len(result.token_ids) == 480
        assert result.stats.total_time_s > 0.25
        assert await stack.sessions_left() == (0, 0)


def test_an_expired_session_is_rebuilt_like_a_lost_one():
    # The coordinator's recovery reopens sessions on Unavailable; an idle
    # close must take that path without marking the worker as down.
    error = error_from_status(grpc.StatusCode.ABORTED, "session idle")
    assert isinstance(error, errors.SessionExpired) and isinstance(error, errors.Unavailable)


async def test_a_deadline_mid_stream_frees_both_workers_sessions(
    tiny_target_dir, tiny_draft_other_dir
):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={NO_EOS}
    ) as stack:
        async with AsyncClient(stack.address) as client:
            chunks = 0
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in client.stream(token_ids=PROMPT, max_new_tokens=500, timeout=1.0):
                    chunks += 1
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert chunks > 0  # the deadline struck mid-stream
        assert await stack.sessions_left(timeout_s=2.0) == (0, 0)
        assert stack.target.store.cached_tokens == 0 and stack.draft.store.cached_tokens == 0


async def test_oversized_messages_get_resource_exhausted(tiny_target_dir):
    big = "x" * (MAX_MESSAGE_BYTES + 1)
    async with running_stack(tiny_target_dir, drafter="prompt-lookup") as stack:
        # Channels without a send limit: the server's receive limit must refuse.
        async with grpc.aio.insecure_channel(stack.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await coordinator_pb2_grpc.CoordinatorStub(channel).Complete(
                    cpb.GenerateRequest(text=big)
                )
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        async with grpc.aio.insecure_channel(stack.target_servers[0].address) as channel:
            call = worker_pb2_grpc.TargetWorkerStub(channel).Session()
            await call.write(wpb.VerifyRequest(open=wpb.SessionOpen(token_ids=PROMPT)))
            await call.read()
            probs = wpb.DraftProbs(probs=b"\0" * (MAX_MESSAGE_BYTES + 2))
            try:
                await call.write(
                    wpb.VerifyRequest(
                        round=wpb.VerifyRound(committed_len=len(PROMPT), draft_probs=[probs])
                    )
                )
            except grpc.aio.AioRpcError:
                pass
            assert (await final_status(call))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await stack.sessions_left() == (0, 0)


@pytest.mark.parametrize(
    "request_id, expected",
    [
        ("\x1f", "request_id[0] = '\\x1f'"),
        ("r" * 129, "request_id has 129 characters"),
        ("é", "printable ASCII"),
    ],
)
async def test_bad_request_ids_get_invalid_argument(tiny_target_dir, request_id, expected):
    async with running_stack(tiny_target_dir) as stack:
        async with AsyncClient(stack.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate(token_ids=PROMPT, max_new_tokens=2, request_id=request_id)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in info.value.details()
        async with grpc.aio.insecure_channel(stack.draft_server.address) as channel:
            call = worker_pb2_grpc.DraftWorkerStub(channel).Session()
            await call.write(
                wpb.DraftRequest(open=wpb.SessionOpen(token_ids=PROMPT, request_id=request_id))
            )
            code, details = await final_status(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "open.request_id" in details
        assert await stack.sessions_left() == (0, 0)


async def test_an_overlong_request_id_header_gets_invalid_argument(tiny_target_dir):
    async with running_stack(tiny_target_dir, drafter="prompt-lookup") as stack:
        async with grpc.aio.insecure_channel(stack.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetModelInfo(
                    cpb.GetModelInfoRequest(), metadata=((REQUEST_ID_KEY, "r" * 300),)
                )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"metadata {REQUEST_ID_KEY} has 300 characters" in info.value.details()


async def test_a_draft_worker_refuses_negative_token_ids(tiny_target_dir):
    async with running_stack(tiny_target_dir) as stack:
        async with grpc.aio.insecure_channel(stack.draft_server.address) as channel:
            call = worker_pb2_grpc.DraftWorkerStub(channel).Session()
            await call.write(wpb.DraftRequest(open=wpb.SessionOpen(token_ids=[3, -7])))
            code, details = await final_status(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert (
                details == "token_ids[1] = -7 is outside the vocabulary: ids must lie in [0, 512)"
            )


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(token_ids=[]), "token_ids.ids is empty: send at least one token id"),
        (dict(token_ids=[1] * 600), "the prompt has 600 tokens but the model's context holds 512"),
        (dict(token_ids=PROMPT, max_new_tokens=506), "at most 505 can be generated"),
        (dict(token_ids=PROMPT, temperature=-1.0), "temperature must be a finite number >= 0"),
        (dict(token_ids=PROMPT, top_p=1.5), "top_p must be in (0, 1]"),
        (
            dict(token_ids=PROMPT, stop_token_ids=[512]),
            "stop_token_ids[0] = 512 is outside the vocabulary [0, 512)",
        ),
    ],
)
async def test_bad_fields_are_named_with_their_limits(tiny_target_dir, kwargs, expected):
    async with running_stack(tiny_target_dir, drafter="prompt-lookup") as stack:
        async with AsyncClient(stack.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate(**kwargs)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in info.value.details()
