"""The worker protocols (``outrider.coordinator.workers.protocol``) over gRPC: one
bidirectional stream per session, and a busy worker told from a frozen one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import grpc

from outrider.coordinator.workers.protocol import (
    Judged,
    Reply,
    WorkerInfo,
)
from outrider.coordinator.workers.replicas import Replica, Replicas
from outrider.engine_load import EngineLoad
from outrider.errors import SessionExpired, Unavailable
from outrider.hidden_states import NONE, HiddenStates
from outrider.logging import get_logger
from outrider.rpc import REQUEST_ID_KEY, error_from_status
from outrider.sampling_params import SamplingParams
from outrider.speculation import Proposal, Verdict
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc
from outrider.wire import (
    hidden_states_from_pb,
    hidden_states_to_pb,
    load_from_pb,
    logprobs_from_pb,
    proposal_from_pb,
    sampling_to_pb,
    verdict_from_pb,
    verify_round_to_pb,
)

T = TypeVar("T")
log = get_logger(__name__)


PROBE_S = 0.5
"""Longest wait for a worker to say whether its engine is stepping."""


async def answer_of(call: Awaitable[T], replica: Replica, deadline_s: float | None) -> T:
    """The answer of ``call`` to ``replica``, however long it takes while the
    replica's engine keeps stepping: a busy worker is not a frozen one.
    Whenever ``deadline_s`` passes without an answer, the replica is asked
    whether its engine is at work — it began or ended a step since this
    call last heard (when it was sent, or at its last probe), or began one
    within the deadline — within the deadline's last quarter (at most
    :data:`PROBE_S`); TimeoutError when it is not, or does not answer
    (frozen, stalled or gone)."""
    if deadline_s is None:
        return await call
    heard = replica.progress_heard()
    task = asyncio.ensure_future(call)
    probe_s = min(PROBE_S, deadline_s / 4)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=deadline_s - probe_s)
            if task in done:
                return task.result()
            probe = asyncio.ensure_future(
                replica.stepping(probe_s, lately_s=deadline_s, since=heard)
            )
            first, _ = await asyncio.wait({task, probe}, return_when=asyncio.FIRST_COMPLETED)
            if task in first:
                probe.cancel()
                return task.result()
            if (progress := probe.result()) is None:
                raise TimeoutError
            heard = progress
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _cancelling() -> bool:
    """Whether the running task is being cancelled (rather than a call it
    awaits having been cancelled under it)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _info_from_pb(info: pb.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(
        model=info.model,
        drafter=info.drafter,
        vocab_size=info.vocab_size,
        vocab_fingerprint=info.vocab_fingerprint,
        max_context=info.max_context_length,
        device=info.device,
        dtype=info.dtype,
        graphed_tokens_per_row=info.graphed_tokens_per_row,
        hidden_state_layers=tuple(info.hidden_state_layers),
    )


def _load(message) -> EngineLoad | None:
    return load_from_pb(message.load) if message.HasField("load") else None


CLOSE_WAIT_S = 2.0
"""How long the worker of a finished session may take to end its stream
(after a round still in flight) before the call is cancelled."""


class _GrpcSession:
    """One worker session: a bidirectional stream, one request and one
    response per step. A worker's error status becomes the domain error of
    the same meaning, so the coordinator passes it on to its client.

    A finished session is closed (the worker counts it done); a session given
    up for any other reason is cancelled (the worker counts it cancelled)."""

    close_request: Any
    """The role's request that carries a SessionClose."""

    def __init__(
        self,
        role: str,
        call: grpc.aio.StreamStreamCall,
        replica: Any,
        close_later: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.role = role
        self._call = call
        self.address = replica.address
        self._replica = replica
        self._close_later = close_later
        replica.load += 1
        self._open = True
        self._turn = asyncio.Lock()
        """One exchange at a time; the close waits for the one in flight."""

    def failing(self) -> None:
        self._replica.failed()

    async def exchange(self, request, deadline_s: float | None = None):
        """Sends ``request`` and returns the worker's response (see
        :func:`answer_of` for ``deadline_s``)."""
        return await answer_of(self._exchange(request), self._replica, deadline_s)

    async def _exchange(self, request):
        async with self._turn:
            try:
                await self._call.write(request)
                response = await self._call.read()
                if response is not grpc.aio.EOF:
                    kind = response.WhichOneof("kind")
                    if kind is not None and getattr(response, kind).HasField("load"):
                        self._replica.answered(load_from_pb(getattr(response, kind).load))
                    return response
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass  # the call has ended; its status says why
            except asyncio.CancelledError:
                if _cancelling():
                    raise
                # Not this task's cancel: the call's, by its channel closing
                # under it (discovery closed a gone worker's). Its status
                # (CANCELLED) says so, and the session fails over.
        code, details = await self._call.code(), await self._call.details()
        error = error_from_status(code, f"{self.role} worker {self.address}: {details}")
        if isinstance(error, Unavailable) and not isinstance(error, SessionExpired):
            self._replica.failed()
        elif code is grpc.StatusCode.INVALID_ARGUMENT:  # the client's: it reads why, not where
            log.info("the worker refused the request", worker=self.address, reason=details)
            error = error_from_status(code, details)
        raise error

    def close(self) -> None:
        """Ends the finished session, in the background: once a round in
        flight (a speculation) has its answer, tells the worker and waits for
        its end of stream, CLOSE_WAIT_S at most, then cancels the call."""
        self._release()
        if not self._call.done():
            self._close_later(self._end())

    def cancel(self) -> None:
        """Cuts the session now: the worker sees its stream cancelled."""
        self._release()
        self._call.cancel()

    def _release(self) -> None:
        if self._open:
            self._replica.load -= 1
            self._open = False

    async def _end(self) -> None:
        try:
            async with asyncio.timeout(CLOSE_WAIT_S), self._turn:
                if not self._call.done():
                    await self._call.write(self.close_request)
                    await self._call.done_writing()
                    await self._call.code()  # once the worker has ended the stream
        except (TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass
        except asyncio.CancelledError:
            # grpc raises it for a call cancelled under it (its channel closed).
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise
        finally:
            self._call.cancel()  # nothing, once the stream has ended


class GrpcDraftSession(_GrpcSession):
    close_request = pb.DraftRequest(close=pb.SessionClose())

    async def propose(
        self, committed_len, new_tokens, k, assumed=None, round_id=0, hidden_states=NONE
    ):
        response = await self.exchange(
            pb.DraftRequest(
                round=pb.DraftRound(
                    committed_len=committed_len,
                    new_token_ids=new_tokens,
                    num_speculative_tokens=k,
                    speculate=assumed is not None,
                    assumed_token_ids=assumed or (),
                    round_id=round_id,
                    hidden_states=hidden_states_to_pb(hidden_states),
                )
            )
        )
        proposal = response.proposal
        return Reply(proposal_from_pb(proposal), proposal.compute_s, _load(proposal))


class GrpcTargetSession(_GrpcSession):
    close_request = pb.VerifyRequest(close=pb.SessionClose())

    async def verify(
        self, committed_len: int, proposal: Proposal, deadline_s: float | None = None
    ) -> Reply[Judged]:
        response = await self.exchange(
            pb.VerifyRequest(round=verify_round_to_pb(committed_len, proposal)), deadline_s
        )
        verdict = response.verdict
        judged = Judged(proposal.prefix(verdict.num_verified), verdict_from_pb(verdict))
        return Reply(
            judged,
            verdict.compute_s,
            _load(verdict),
            verdict.queued_s,
            hidden_states_from_pb(verdict.hidden_states),
        )


class GrpcWorkerClient:
    """The replicas of one worker role, and sessions opened on them."""

    def __init__(
        self,
        role: str,
        addresses: Sequence[str],
        stub_class: Callable[[grpc.aio.Channel], Any],
        session_class: type[_GrpcSession],
        *,
        credentials: grpc.ChannelCredentials | None = None,
        kube_api=None,
        prefix_routing: bool = True,
    ) -> None:
        self.role = role
        self.session_class = session_class
        self.replicas = Replicas(
            role,
            addresses,
            stub_class,
            credentials=credentials,
            kube_api=kube_api,
            prefix_routing=prefix_routing,
        )

    async def start(self) -> None:
        """Starts discovering the replicas of ``k8s://`` addresses."""
        await self.replicas.start()

    async def info(self, timeout_s: float = 10.0) -> WorkerInfo:
        """Waits up to ``timeout_s`` for a replica that takes sessions to answer."""
        return _info_from_pb(await self.replicas.wait_ready(timeout_s))

    async def close(self) -> None:
        await self.replicas.close()

    async def _open(self, request, *, request_id: str, deadline_s: float | None = None):
        """Opens a session on a replica; one that does not answer within
        ``deadline_s`` (frozen) or is unavailable (gone, draining) counts as
        failed, so that new sessions, this one's reopen too, go to the others
        first whatever prefixes it holds: Unavailable."""
        replica = await self.replicas.choose(deadline_s, request.open.token_ids)
        try:
            call = replica.stub.Session(metadata=((REQUEST_ID_KEY, request_id),))
        except grpc.aio.UsageError:  # its channel closed since it was chosen: it is gone
            raise Unavailable(f"{self.role} worker {replica.address} is gone") from None
        session = self.session_class(self.role, call, replica, self.replicas.close_later)
        try:
            response = await session.exchange(request, deadline_s)
        except TimeoutError:
            session.cancel()
            replica.failed()
            raise Unavailable(
                f"{self.role} worker {replica.address} did not open the session "
                f"within {deadline_s:.3g} s"
            ) from None
        except Unavailable:
            session.cancel()
            replica.failed()
            raise
        except BaseException:
            session.cancel()
            raise
        replica.opened()
        opened = response.opened
        first = (
            Verdict(0, opened.first_token_id, logprobs_from_pb(opened.logprobs))
            if opened.HasField("first_token_id")
            else None
        )
        features = hidden_states_from_pb(opened.hidden_states)
        return session, Reply(
            first,
            opened.compute_s,
            _load(opened),
            hidden_states=features,
            cached_tokens=opened.cached_tokens,
        )


class GrpcDraftClient(GrpcWorkerClient):
    def __init__(
        self, addresses: Sequence[str], *, credentials=None, kube_api=None, prefix_routing=True
    ) -> None:
        super().__init__(
            "draft",
            addresses,
            worker_pb2_grpc.DraftWorkerStub,
            GrpcDraftSession,
            credentials=credentials,
            kube_api=kube_api,
            prefix_routing=prefix_routing,
        )

    async def open(
        self,
        tokens,
        *,
        request_id: str,
        target: WorkerInfo,
        sampling: SamplingParams,
        deadline_s: float | None = None,
        hidden_states: HiddenStates = NONE,
    ):
        request = pb.DraftRequest(
            open=pb.SessionOpen(
                token_ids=tokens,
                request_id=request_id,
                target_vocab_size=target.vocab_size,
                target_vocab_fingerprint=target.vocab_fingerprint,
                sampling=sampling_to_pb(sampling),
                hidden_states=hidden_states_to_pb(hidden_states),
            )
        )
        session, opened = await self._open(request, request_id=request_id, deadline_s=deadline_s)
        return session, opened.compute_s


class GrpcTargetClient(GrpcWorkerClient):
    def __init__(
        self, addresses: Sequence[str], *, credentials=None, kube_api=None, prefix_routing=True
    ) -> None:
        super().__init__(
            "target",
            addresses,
            worker_pb2_grpc.TargetWorkerStub,
            GrpcTargetSession,
            credentials=credentials,
            kube_api=kube_api,
            prefix_routing=prefix_routing,
        )

    async def open(
        self,
        tokens,
        *,
        request_id: str,
        sampling: SamplingParams,
        deadline_s: float | None = None,
        first_token: bool = False,
        hidden_state_layers=(),
    ):
        request = pb.VerifyRequest(
            open=pb.SessionOpen(
                token_ids=tokens,
                request_id=request_id,
                sampling=sampling_to_pb(sampling),
                first_token=first_token,
                hidden_state_layers=hidden_state_layers,
            )
        )
        return await self._open(request, request_id=request_id, deadline_s=deadline_s)
