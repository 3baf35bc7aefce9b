"""How the coordinator talks to its workers.

The round loop sees only the small protocols below. Two implementations:
gRPC (one bidirectional stream per session, the production path) and
in-process (the engines called directly, so the whole speculative loop runs
in one process in unit tests) — the same loop code either way.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from outrider.engine_thread import EngineThread
from outrider.errors import Unavailable
from outrider.rpc import CHANNEL_OPTIONS, REQUEST_ID_KEY, error_from_status
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


@dataclass(frozen=True)
class Proposal:
    draft_tokens: list[int]
    compute_s: float
    draft_probs: list[CompactProbs] = field(default_factory=list)
    """q of each draft token (rejection mode with a sampling draft), else empty."""


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    next_token: int
    compute_s: float


class DraftSession(Protocol):
    async def propose(self, committed_len: int, new_tokens: Sequence[int], k: int) -> Proposal: ...
    async def close(self) -> None: ...


class TargetSession(Protocol):
    async def verify(
        self, committed_len: int, draft_tokens: Sequence[int], draft_probs: Sequence[CompactProbs] = ()
    ) -> VerifyResult: ...
    async def close(self) -> None: ...


class DraftClient(Protocol):
    async def info(self, timeout_s: float = 10.0) -> WorkerInfo: ...
    async def open(
        self, tokens: Sequence[int], *, request_id: str, target: WorkerInfo, sampling: SamplingParams
    ) -> tuple[DraftSession, float]: ...


class TargetClient(Protocol):
    async def info(self, timeout_s: float = 10.0) -> WorkerInfo: ...
    async def open(
        self, tokens: Sequence[int], *, request_id: str, sampling: SamplingParams
    ) -> tuple[TargetSession, float]: ...


# --- gRPC ------------------------------------------------------------------


def _info_from_pb(info: pb.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(
        model=info.model,
        drafter=info.drafter,
        vocab_size=info.vocab_size,
        vocab_fingerprint=info.vocab_fingerprint,
        max_context=info.max_context_length,
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
        if isinstance(error, Unavailable):
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

    async def propose(self, committed_len: int, new_tokens: Sequence[int], k: int) -> Proposal:
        response = await self.exchange(
            pb.DraftRequest(
                round=pb.DraftRound(
                    committed_len=committed_len, new_token_ids=new_tokens, num_draft_tokens=k
                )
            )
        )
        proposal = response.proposal
        return Proposal(list(proposal.draft_token_ids), proposal.compute_s, probs_from_pb(proposal.draft_probs))


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


# A worker that comes back is found again within a second or two, not after
# gRPC's default reconnect back-off of up to two minutes.
WORKER_CHANNEL_OPTIONS = (
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


class _Replicas:
    """Channels to one role's worker replicas; new sessions go to the replica
    with the fewest sessions opened by this coordinator."""

    def __init__(self, addresses: Sequence[str], stub_class, *, credentials=None) -> None:
        if not addresses:
            raise ValueError("at least one worker address is needed")
        self.addresses = list(addresses)
        self._channels = [
            grpc.aio.secure_channel(a, credentials, options=WORKER_CHANNEL_OPTIONS)
            if credentials
            else grpc.aio.insecure_channel(a, options=WORKER_CHANNEL_OPTIONS)
            for a in self.addresses
        ]
        self.stubs = [stub_class(ch) for ch in self._channels]
        self.load = [0] * len(self.addresses)
        self.down_until = [0.0] * len(self.addresses)
        self._tiebreak = itertools.count()

    def pick(self) -> int:
        """The replica to open a session on: one not recently failed, then
        the least loaded, ties taken in turn."""
        turn = next(self._tiebreak)
        n = len(self.load)
        now = time.monotonic()
        return min(range(n), key=lambda i: (self.down_until[i] > now, self.load[i], (i - turn) % n))

    def failed(self, index: int, *, for_s: float = 5.0) -> None:
        self.down_until[index] = time.monotonic() + for_s

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self._channels))


async def _wait_ready(replicas: _Replicas, role: str, *, timeout_s: float) -> WorkerInfo:
    """Waits until the first replica of a role answers; returns its description."""
    try:
        response = await replicas.stubs[0].GetWorkerInfo(
            pb.GetWorkerInfoRequest(), wait_for_ready=True, timeout=timeout_s
        )
    except grpc.aio.AioRpcError as exc:
        raise Unavailable(
            f"no {role} worker answered at {replicas.addresses[0]} within {timeout_s:.0f} s: {exc.details()}"
        ) from exc
    return _info_from_pb(response)


async def _open(replicas: _Replicas, session_class, request, *, request_id: str):
    index = replicas.pick()
    replicas.load[index] += 1

    def release() -> None:
        replicas.load[index] -= 1

    call = replicas.stubs[index].Session(metadata=((REQUEST_ID_KEY, request_id),))
    session = session_class(call, replicas.addresses[index], release, lambda: replicas.failed(index))
    try:
        response = await session.exchange(request)
    except BaseException:
        await session.close()
        raise
    return session, response.opened.compute_s


class GrpcDraftClient:
    def __init__(self, addresses: Sequence[str], *, credentials=None) -> None:
        self.replicas = _Replicas(addresses, worker_pb2_grpc.DraftWorkerStub, credentials=credentials)

    async def info(self, timeout_s: float = 10.0) -> WorkerInfo:
        """Waits up to ``timeout_s`` for the first replica to answer."""
        return await _wait_ready(self.replicas, "draft", timeout_s=timeout_s)

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
    def __init__(self, addresses: Sequence[str], *, credentials=None) -> None:
        self.replicas = _Replicas(addresses, worker_pb2_grpc.TargetWorkerStub, credentials=credentials)

    async def info(self, timeout_s: float = 10.0) -> WorkerInfo:
        """Waits up to ``timeout_s`` for the first replica to answer."""
        return await _wait_ready(self.replicas, "target", timeout_s=timeout_s)

    async def open(self, tokens, *, request_id: str, sampling: SamplingParams):
        request = pb.VerifyRequest(
            open=pb.SessionOpen(token_ids=tokens, request_id=request_id, sampling=sampling_to_pb(sampling))
        )
        return await _open(self.replicas, GrpcTargetSession, request, request_id=request_id)

    async def close(self) -> None:
        await self.replicas.close()


# --- in-process ---------------------------------------------------------------


class InProcessTargetClient:
    """Calls a TargetEngine directly on its engine thread (tests, one-process use)."""

    def __init__(self, engine, thread: EngineThread) -> None:
        self.engine = engine
        self.thread = thread

    async def info(self, timeout_s: float = 10.0) -> WorkerInfo:
        i = self.engine.info
        return WorkerInfo(i.model_name, "", i.vocab_size, i.vocab_fingerprint, i.max_context)

    async def open(self, tokens, *, request_id: str, sampling: SamplingParams):
        session_id = uuid.uuid4().hex[:16]
        loop = asyncio.get_running_loop()
        start = loop.time()
        await self.thread.run(self.engine.open, session_id, list(tokens), sampling)
        return _InProcessTargetSession(self, session_id), loop.time() - start


class _InProcessTargetSession:
    def __init__(self, client: InProcessTargetClient, session_id: str) -> None:
        self.client = client
        self.session_id = session_id

    async def verify(self, committed_len, draft_tokens, draft_probs=()) -> VerifyResult:
        loop = asyncio.get_running_loop()
        start = loop.time()
        v = await self.client.thread.run(
            self.client.engine.verify, self.session_id, committed_len, list(draft_tokens), list(draft_probs)
        )
        return VerifyResult(v.num_accepted, v.next_token, loop.time() - start)

    async def close(self) -> None:
        self.client.thread.submit(self.client.engine.close, self.session_id)


class InProcessDraftClient:
    """Calls a DraftEngine directly on its engine thread."""

    def __init__(self, engine, thread: EngineThread) -> None:
        self.engine = engine
        self.thread = thread

    async def info(self, timeout_s: float = 10.0) -> WorkerInfo:
        d = self.engine.drafter
        i = self.engine.info
        return WorkerInfo(d.model_name, d.kind, d.vocab_size or 0, i.vocab_fingerprint, i.max_context)

    async def open(self, tokens, *, request_id: str, target: WorkerInfo, sampling: SamplingParams):
        session_id = uuid.uuid4().hex[:16]
        loop = asyncio.get_running_loop()
        start = loop.time()
        await self.thread.run(
            self.engine.open, session_id, list(tokens), target.vocab_size, target.vocab_fingerprint, sampling
        )
        return _InProcessDraftSession(self, session_id), loop.time() - start


class _InProcessDraftSession:
    def __init__(self, client: InProcessDraftClient, session_id: str) -> None:
        self.client = client
        self.session_id = session_id

    async def propose(self, committed_len, new_tokens, k) -> Proposal:
        loop = asyncio.get_running_loop()
        start = loop.time()
        tokens, probs = await self.client.thread.run(
            self.client.engine.propose, self.session_id, committed_len, list(new_tokens), k
        )
        return Proposal(tokens, loop.time() - start, probs)

    async def close(self) -> None:
        self.client.thread.submit(self.client.engine.close, self.session_id)
