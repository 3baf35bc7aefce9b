"""A worker session's exchange over gRPC: a call whose channel closes under
it (discovery closing a gone worker's) fails over as UNAVAILABLE; a
cancel of the coordinator's own task stays a cancel."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from outrider.coordinator.workers.grpc_client import GrpcTargetSession, answer_of
from outrider.coordinator.workers.replicas import Replica
from outrider.errors import Unavailable
from outrider.speculation import Proposal
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc


class SilentWorker(worker_pb2_grpc.TargetWorkerServicer):
    """Takes every request and answers none (a held engine)."""

    async def Session(self, request_iterator, context):
        async for _ in request_iterator:
            await asyncio.sleep(60)
        yield pb.VerifyResponse()


@contextlib.asynccontextmanager
async def serving(worker: worker_pb2_grpc.TargetWorkerServicer) -> AsyncIterator[Replica]:
    """A replica of ``worker``, served on a free local port while in use."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_TargetWorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Replica(f"127.0.0.1:{port}", channel, worker_pb2_grpc.TargetWorkerStub(channel))
    finally:
        await channel.close()
        await server.stop(0)


@pytest.fixture
async def replica():
    async with serving(SilentWorker()) as replica:
        yield replica


async def verify_in_flight(replica: Replica) -> asyncio.Task:
    session = GrpcTargetSession("target", replica.stub.Session(), replica, lambda closing: None)
    task = asyncio.ensure_future(session.verify(1, Proposal([])))
    await asyncio.sleep(0.2)  # written, and waiting for the verdict
    assert not task.done()
    return task


async def test_a_verify_whose_channel_closes_under_it_is_unavailable(replica):
    task = await verify_in_flight(replica)
    await replica.channel.close()
    with pytest.raises(Unavailable, match="CANCELLED"):
        await task
    assert replica.failures == 1  # new sessions go to the other replicas first


async def test_a_cancel_of_the_waiting_task_is_still_a_cancel(replica):
    task = await verify_in_flight(replica)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_replica_whose_channel_closed_is_not_stepping(replica):
    await replica.channel.close()
    assert await replica.stepping(1.0, lately_s=1.0, since=0) is None


class BetweenStepsWorker(SilentWorker):
    """A held engine that says it has begun its fifth step and is between
    steps now; counts how often it is asked."""

    def __init__(self) -> None:
        self.asked = 0

    async def GetWorkerInfo(self, request, context):
        self.asked += 1
        return pb.WorkerInfo(load=pb.EngineLoad(steps=5, running_s=0.0))


async def test_each_waiting_call_hears_of_a_step_for_itself():
    """Two calls wait on one replica whose engine began and ended a step
    since both were sent. Each one's first probe hears of it — one call's
    probe does not spend the news for the other — and each next probe, with
    no step since, finds the engine at rest: two probes a call, then
    TimeoutError."""
    worker = BetweenStepsWorker()
    async with serving(worker) as replica:
        replica.steps = 4  # as it last said when the calls were sent (under way)
        waits = [answer_of(asyncio.Event().wait(), replica, deadline_s=0.4) for _ in range(2)]
        outcomes = await asyncio.gather(*waits, return_exceptions=True)
        assert all(isinstance(outcome, TimeoutError) for outcome in outcomes)
        assert worker.asked == 4


async def test_a_step_that_ended_since_the_last_probe_is_news():
    """A call's last probe found the engine's fifth step under way; the
    step has ended since — it may have answered the call, its answer on its
    way — and the engine rests between steps: at work once more."""
    async with serving(BetweenStepsWorker()) as replica:
        under_way = 2 * 5 - 1
        assert await replica.stepping(1.0, lately_s=0.2, since=under_way) == 10
        assert await replica.stepping(1.0, lately_s=0.2, since=10) is None
