"""How the coordinator talks to its workers.

The round loop sees only the small protocols below. Two implementations:
gRPC (one bidirectional stream per session, the production path) and
in-process (the engines called directly, so the whole speculative loop runs
in one process in unit tests) — the same loop code either way.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from coordinator.replicas import Replicas
from outrider.engine import Engine, InlineEngine
from outrider.errors import SessionExpired, Unavailable
from outrider.rpc import REQUEST_ID_KEY, error_from_status
from outrider.sampling import CompactProbs, SamplingParams
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc
from outrider.wire import probs_from_pb, probs_to_pb, sampling_to_pb


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
class Proposal:
    draft_tokens: list[int]
    compute_s: float
    draft_probs: list[CompactProbs] = field(default_factory=list)
    """q of each draft token (rejection mode with a sampling draft), else empty."""
    round_id: int = 0
    """The round it answers (echoed)."""
    follows_len: int = 0
    """The length of the history the drafts follow."""
    guess: int | None = None
    """A speculation's guess of the bonus token after the assumed drafts."""


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    next_token: int
    compute_s: float


class DraftSession(Protocol):
    async def propose(
        self,
        committed_len: int,
        new_tokens: Sequence[int],
        k: int,
        assumed: Sequence[int] | None = None,
        round_id: int = 0,
    ) -> Proposal:
        """Syncs the new committed tokens and proposes up to k drafts after
        the history; given ``assumed`` drafts (even none), a speculation:
        a guess of the bonus token after them, then the drafts after that."""
        ...

    async def close(self) -> None: ...


class TargetSession(Protocol):
    async def verify(
        self,
        committed_len: int,
        draft_tokens: Sequence[int],
        draft_probs: Sequence[CompactProbs] = (),
    ) -> VerifyResult: ...
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

    role = "worker"

    def __init__(
        self,
        call: grpc.aio.StreamStreamCall,
        address: str,
        release: Callable[[], None],
        failed: Callable[[], None] = lambda: None,
    ) -> None:
        self._call = call
        self.address = address
        self._release = release
        self._failed = failed

    def failing(self) -> None:
        self._failed()

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
            self._failed()
        raise error

    async def close(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None
        # Half-close, then cancel: the worker frees the session either way.
        if not self._call.done():
            try:
                await self._call.done_writing()
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass
            self._call.cancel()


class GrpcDraftSession(_GrpcSession):
    role = "draft"

    async def propose(self, committed_len, new_tokens, k, assumed=None, round_id=0) -> Proposal:
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
        p = response.proposal
        return Proposal(
            list(p.draft_token_ids),
            p.compute_s,
            probs_from_pb(p.draft_probs),
            round_id=p.round_id,
            follows_len=p.follows_len,
            guess=p.guess_token_id if p.HasField("guess_token_id") else None,
        )


class GrpcTargetSession(_GrpcSession):
    role = "target"

    async def verify(self, committed_len, draft_tokens, draft_probs=()) -> VerifyResult:
        response = await self.exchange(
            pb.VerifyRequest(
                round=pb.VerifyRound(
                    committed_len=committed_len,
                    draft_token_ids=draft_tokens,
                    draft_probs=probs_to_pb(draft_probs),
                )
            )
        )
        verdict = response.verdict
        return VerifyResult(verdict.num_accepted, verdict.next_token_id, verdict.compute_s)


async def _open(
    replicas: Replicas, session_class, request, *, request_id: str, deadline_s: float | None = None
):
    """Opens a session on a replica; one that does not answer within
    ``deadline_s`` (frozen) counts as failed: Unavailable."""
    replica = await replicas.choose()
    replica.load += 1

    def release() -> None:
        replica.load -= 1

    call = replica.stub.Session(metadata=((REQUEST_ID_KEY, request_id),))
    session = session_class(call, replica.address, release, replica.failed)
    try:
        async with asyncio.timeout(deadline_s):
            response = await session.exchange(request)
    except TimeoutError:
        await session.close()
        replica.failed()
        raise Unavailable(
            f"{session.role} worker {replica.address} did not open the session within {deadline_s:.3g} s"
        ) from None
    except BaseException:
        await session.close()
        raise
    replica.opened()
    return session, response.opened.compute_s


class GrpcDraftClient:
    def __init__(self, addresses: Sequence[str], *, credentials=None, kube_api=None) -> None:
        self.replicas = Replicas(
            "draft",
            addresses,
            worker_pb2_grpc.DraftWorkerStub,
            credentials=credentials,
            kube_api=kube_api,
        )

    async def start(self) -> None:
        """Starts discovering the replicas of ``k8s://`` addresses."""
        await self.replicas.start()

    async def info(self, timeout_s: float = 10.0) -> WorkerInfo:
        """Waits up to ``timeout_s`` for a replica that takes sessions to answer."""
        return _info_from_pb(await self.replicas.wait_ready(timeout_s))

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
        return await _open(self.replicas, GrpcDraftSession, request, request_id=request_id)

    async def close(self) -> None:
        await self.replicas.close()


class GrpcTargetClient:
    def __init__(self, addresses: Sequence[str], *, credentials=None, kube_api=None) -> None:
        self.replicas = Replicas(
            "target",
            addresses,
            worker_pb2_grpc.TargetWorkerStub,
            credentials=credentials,
            kube_api=kube_api,
        )

    async def start(self) -> None:
        """Starts discovering the replicas of ``k8s://`` addresses."""
        await self.replicas.start()

    async def info(self, timeout_s: float = 10.0) -> WorkerInfo:
        """Waits up to ``timeout_s`` for a replica that takes sessions to answer."""
        return _info_from_pb(await self.replicas.wait_ready(timeout_s))

    async def open(
        self, tokens, *, request_id: str, sampling: SamplingParams, deadline_s: float | None = None
    ):
        request = pb.VerifyRequest(
            open=pb.SessionOpen(
                token_ids=tokens, request_id=request_id, sampling=sampling_to_pb(sampling)
            )
        )
        return await _open(
            self.replicas, GrpcTargetSession, request, request_id=request_id, deadline_s=deadline_s
        )

    async def close(self) -> None:
        await self.replicas.close()


# --- in-process ---------------------------------------------------------------


class InProcessTargetClient:
    """Runs a worker's TargetSessions jobs on its engine directly (tests, one-process use)."""

    def __init__(self, sessions, engine: Engine | InlineEngine) -> None:
        self.sessions = sessions
        self.engine = engine

    async def info(self, timeout_s: float = 10.0) -> WorkerInfo:
        i = self.sessions.info
        return WorkerInfo(
            i.model_name, "", i.vocab_size, i.vocab_fingerprint, i.max_context, i.device, i.dtype
        )

    async def open(
        self, tokens, *, request_id: str, sampling: SamplingParams, deadline_s: float | None = None
    ):
        session_id = uuid.uuid4().hex[:16]
        _, compute_s = await self.engine.timed(
            self.sessions.open, session_id, list(tokens), sampling
        )
        return _InProcessTargetSession(self, session_id), compute_s


class _InProcessTargetSession:
    def __init__(self, client: InProcessTargetClient, session_id: str) -> None:
        self.client = client
        self.session_id = session_id

    async def verify(self, committed_len, draft_tokens, draft_probs=()) -> VerifyResult:
        v, compute_s = await self.client.engine.timed(
            self.client.sessions.verify,
            self.session_id,
            committed_len,
            list(draft_tokens),
            list(draft_probs),
        )
        return VerifyResult(v.num_accepted, v.next_token, compute_s)

    def failing(self) -> None:
        pass

    async def close(self) -> None:
        self.client.engine.submit(self.client.sessions.close, self.session_id)


class InProcessDraftClient:
    """Runs a worker's DraftSessions jobs on its engine directly."""

    def __init__(self, sessions, engine: Engine | InlineEngine) -> None:
        self.sessions = sessions
        self.engine = engine

    async def info(self, timeout_s: float = 10.0) -> WorkerInfo:
        d, i = self.sessions.drafter, self.sessions.info
        return WorkerInfo(
            d.model_name,
            d.kind,
            d.vocab_size or 0,
            i.vocab_fingerprint,
            i.max_context,
            i.device,
            i.dtype,
        )

    async def open(self, tokens, *, request_id: str, target: WorkerInfo, sampling: SamplingParams):
        session_id = uuid.uuid4().hex[:16]
        _, compute_s = await self.engine.timed(
            self.sessions.open,
            session_id,
            list(tokens),
            target.vocab_size,
            target.vocab_fingerprint,
            sampling,
        )
        return _InProcessDraftSession(self, session_id), compute_s


class _InProcessDraftSession:
    def __init__(self, client: InProcessDraftClient, session_id: str) -> None:
        self.client = client
        self.session_id = session_id

    async def propose(self, committed_len, new_tokens, k, assumed=None, round_id=0) -> Proposal:
        drafts, compute_s = await self.client.engine.timed(
            self.client.sessions.propose,
            self.session_id,
            committed_len,
            list(new_tokens),
            k,
            assumed,
        )
        return Proposal(
            drafts.tokens, compute_s, drafts.probs, round_id, drafts.follows_len, drafts.guess
        )

    async def close(self) -> None:
        self.client.engine.submit(self.client.sessions.close, self.session_id)
