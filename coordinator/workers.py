"""How the coordinator talks to its workers.

The round loop sees only the small protocols below; this module implements
them over gRPC (one bidirectional stream per session). The test suite has an
in-process implementation (``tests/inprocess.py``) that calls the workers'
engines directly, so the whole speculative loop also runs in one process —
the same loop code either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc

from coordinator.replicas import Replicas
from outrider.errors import SessionExpired, Unavailable
from outrider.rpc import REQUEST_ID_KEY, error_from_status
from outrider.sampling import SamplingParams
from outrider.speculation import Proposal, Verdict
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc
from outrider.wire import proposal_from_pb, sampling_to_pb, verdict_from_pb, verify_round_to_pb

T = TypeVar("T")


@dataclass(frozen=True)
class WorkerInfo:
    model: str
    drafter: str
    vocab_size: int
    vocab_fingerprint: str
    max_context: int
    device: str = ""
    dtype: str = ""


@dataclass(frozen=True)
class Reply(Generic[T]):
    """A worker's answer and the compute it took there (its engine's steps,
    shared with other sessions, included)."""

    value: T
    compute_s: float


class DraftSession(Protocol):
    async def propose(
        self,
        committed_len: int,
        new_tokens: Sequence[int],
        k: int,
        assumed: Sequence[int] | None = None,
        round_id: int = 0,
    ) -> Reply[Proposal]:
        """Syncs the new committed tokens and proposes up to k drafts after
        the history; given ``assumed`` drafts (even none), a speculation:
        a guess of the bonus token after them, then the drafts after that."""
        ...

    async def close(self) -> None: ...


class TargetSession(Protocol):
    async def verify(self, committed_len: int, proposal: Proposal) -> Reply[Verdict]: ...

    def failing(self) -> None:
        """Says the session's worker stopped answering: new sessions go to
        other replicas for a while."""

    async def close(self) -> None: ...


class DraftClient(Protocol):
    async def info(self, timeout_s: float = 10.0) -> WorkerInfo: ...

    async def open(
        self,
        tokens: Sequence[int],
        *,
        request_id: str,
        target: WorkerInfo,
        sampling: SamplingParams,
    ) -> tuple[DraftSession, float]: ...


class TargetClient(Protocol):
    async def info(self, timeout_s: float = 10.0) -> WorkerInfo: ...

    async def open(
        self,
        tokens: Sequence[int],
        *,
        request_id: str,
        sampling: SamplingParams,
        deadline_s: float | None = None,
    ) -> tuple[TargetSession, float]: ...


# --- gRPC ------------------------------------------------------------------


def _info_from_pb(info: pb.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(
        model=info.model,
        drafter=info.drafter,
        vocab_size=info.vocab_size,
        vocab_fingerprint=info.vocab_fingerprint,
        max_context=info.max_context_length,
        device=info.device,
        dtype=info.dtype,
    )


class _GrpcSession:
    """One worker session: a bidirectional stream, one request and one
    response per step. A worker's error status becomes the domain error of
    the same meaning, so the coordinator passes it on to its client."""

    def __init__(self, role: str, call: grpc.aio.StreamStreamCall, replica: Any) -> None:
        self.role = role
        self._call = call
        self.address = replica.address
        self._replica = replica
        replica.load += 1
        self._open = True

    def failing(self) -> None:
        self._replica.failed()

    async def exchange(self, request):
        try:
            await self._call.write(request)
            response = await self._call.read()
            if response is not grpc.aio.EOF:
                return response
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call has ended; its status says why
        code, details = await self._call.code(), await self._call.details()
        error = error_from_status(code, f"{self.role} worker {self.address}: {details}")
        if isinstance(error, Unavailable) and not isinstance(error, SessionExpired):
            self._replica.failed()
        raise error

    async def close(self) -> None:
        if self._open:
            self._replica.load -= 1
            self._open = False
        # Half-close, then cancel: the worker frees the session either way
        # (also when this close is itself cancelled).
        if not self._call.done():
            try:
                await self._call.done_writing()
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass
            finally:
                self._call.cancel()


class GrpcDraftSession(_GrpcSession):
    async def propose(self, committed_len, new_tokens, k, assumed=None, round_id=0):
        response = await self.exchange(
            pb.DraftRequest(
                round=pb.DraftRound(
                    committed_len=committed_len,
                    new_token_ids=new_tokens,
                    num_draft_tokens=k,
                    speculate=assumed is not None,
                    assumed_token_ids=assumed or (),
                    round_id=round_id,
                )
            )
        )
        return Reply(proposal_from_pb(response.proposal), response.proposal.compute_s)


class GrpcTargetSession(_GrpcSession):
    async def verify(self, committed_len: int, proposal: Proposal) -> Reply[Verdict]:
        response = await self.exchange(
            pb.VerifyRequest(round=verify_round_to_pb(committed_len, proposal))
        )
        return Reply(verdict_from_pb(response.verdict), response.verdict.compute_s)


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
    ) -> None:
        self.role = role
        self.session_class = session_class
        self.replicas = Replicas(
            role, addresses, stub_class, credentials=credentials, kube_api=kube_api
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
        ``deadline_s`` (frozen) counts as failed: Unavailable."""
        replica = await self.replicas.choose()
        call = replica.stub.Session(metadata=((REQUEST_ID_KEY, request_id),))
        session = self.session_class(self.role, call, replica)
        try:
            async with asyncio.timeout(deadline_s):
                response = await session.exchange(request)
        except TimeoutError:
            await session.close()
            replica.failed()
            raise Unavailable(
                f"{self.role} worker {replica.address} did not open the session "
                f"within {deadline_s:.3g} s"
            ) from None
        except BaseException:
            await session.close()
            raise
        replica.opened()
        return session, response.opened.compute_s


class GrpcDraftClient(GrpcWorkerClient):
    def __init__(self, addresses: Sequence[str], *, credentials=None, kube_api=None) -> None:
        super().__init__(
            "draft",
            addresses,
            worker_pb2_grpc.DraftWorkerStub,
            GrpcDraftSession,
            credentials=credentials,
            kube_api=kube_api,
        )

    async def open(self, tokens, *, request_id: str, target: WorkerInfo, sampling: SamplingParams):
        request = pb.DraftRequest(
            open=pb.SessionOpen(
                token_ids=tokens,
                request_id=request_id,
                target_vocab_size=target.vocab_size,
                target_vocab_fingerprint=target.vocab_fingerprint,
                sampling=sampling_to_pb(sampling),
            )
        )
        return await self._open(request, request_id=request_id)


class GrpcTargetClient(GrpcWorkerClient):
    def __init__(self, addresses: Sequence[str], *, credentials=None, kube_api=None) -> None:
        super().__init__(
            "target",
            addresses,
            worker_pb2_grpc.TargetWorkerStub,
            GrpcTargetSession,
            credentials=credentials,
            kube_api=kube_api,
        )

    async def open(
        self,
        tokens,
        *,
        request_id: str,
        sampling: SamplingParams,
        deadline_s: float | None = None,
    ):
        request = pb.VerifyRequest(
            open=pb.SessionOpen(
                token_ids=tokens, request_id=request_id, sampling=sampling_to_pb(sampling)
            )
        )
        return await self._open(request, request_id=request_id, deadline_s=deadline_s)
