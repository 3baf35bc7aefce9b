"""The worker side of a session stream, shared by both workers.

One bidirectional stream is one session: the first request opens it, each
later request is one round, a close ends it, and when the stream ends —
closed, cancelled, deadline, coordinator gone — the session and its KV cache
are freed at once. The metrics count it ``done`` only when the coordinator
closed it; a stream that ends without a close was cut (a cancel and a lost
connection read the same as a half-close: the requests end), so it counts as
``cancelled`` and ends CANCELLED.
Session lifetime is stream lifetime: nothing can leak, so no collector of
orphans is needed. A stream that stays open but brings no message for
``idle_timeout_s`` (a stalled coordinator, a client that stopped reading)
is ended by the worker with ABORTED, which frees the session the same way.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from outrider.errors import FailedPrecondition, InvalidArgument, OutriderError, SessionExpired
from outrider.logging import bind_contextvars, get_logger
from outrider.rpc import status_of
from outrider.v1 import worker_pb2
from outrider.validation import check_request_id
from outrider.wire import load_to_pb

if TYPE_CHECKING:
    from outrider.engine import Engine, InlineEngine
    from outrider.metrics import WorkerMetrics

log = get_logger(__name__)
Response = TypeVar("Response", worker_pb2.VerifyResponse, worker_pb2.DraftResponse)


async def session_stream(
    requests: AsyncIterable[Any],
    context: grpc.aio.ServicerContext,
    *,
    engine: Engine | InlineEngine,
    on_open: Callable[[str, Any], Awaitable[Response]],
    on_round: Callable[[str, Any], Awaitable[Response]],
    close: Callable[[str], None],
    idle_timeout_s: float,
    metrics: WorkerMetrics | None = None,
) -> AsyncIterator[Response]:
    session_id = uuid.uuid4().hex[:16]
    bind_contextvars(session_id=session_id)
    opened = False
    ended = "cancelled"  # how the stream ended, for the metrics
    try:
        async for request in _until_idle(requests, idle_timeout_s):
            kind = request.WhichOneof("kind")
            if kind == "open":
                if opened:
                    raise InvalidArgument(
                        "the session is already open: later messages must be rounds"
                    )
                response = await _open(session_id, request.open, on_open, metrics)
                opened = True
                yield response
            elif kind == "round":
                if not opened:
                    raise FailedPrecondition("the first message of a session must open it")
                yield await _round(session_id, request.round, on_round, metrics)
            elif kind == "close":
                ended = "done"
                return
            else:
                raise InvalidArgument("each session message must set 'open', 'round' or 'close'")
        context.set_code(grpc.StatusCode.CANCELLED)
        context.set_details("the session stream ended without a close message")
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:
        ended = status_of(exc).name if isinstance(exc, OutriderError) else "INTERNAL"
        raise
    finally:
        # Runs between engine steps: a round still waiting for one ends first.
        engine.submit(close, session_id)
        if metrics and opened:
            metrics.closed.labels(ended).inc()
        log.debug("session closed", ended=ended)


async def _open(
    session_id: str,
    open_: Any,
    on_open: Callable[[str, Any], Awaitable[Response]],
    metrics: WorkerMetrics | None,
) -> Response:
    """Opens the session: binds the request id it names into the logs, then
    prefills (its time counted, or its refusal by status)."""
    if open_.request_id:
        check_request_id(open_.request_id, what="open.request_id")
        bind_contextvars(request_id=open_.request_id)
    started = time.perf_counter()
    try:
        response = await on_open(session_id, open_)
    except OutriderError as exc:
        if metrics:
            metrics.rejected.labels(status_of(exc).name).inc()
        raise
    if metrics:
        metrics.session_opened(
            len(open_.token_ids), response.opened.cached_tokens, time.perf_counter() - started
        )
    log.debug("session opened", committed_len=len(open_.token_ids))
    return response


async def _round(
    session_id: str,
    round_: Any,
    on_round: Callable[[str, Any], Awaitable[Response]],
    metrics: WorkerMetrics | None,
) -> Response:
    """One round (its time counted)."""
    started = time.perf_counter()
    response = await on_round(session_id, round_)
    if metrics:
        metrics.round_seconds.observe(time.perf_counter() - started)
    return response


async def _until_idle(requests: AsyncIterable[Any], idle_timeout_s: float) -> AsyncIterator[Any]:
    """The stream's messages; SessionExpired once none came for ``idle_timeout_s``."""
    iterator = aiter(requests)
    while True:
        try:
            async with asyncio.timeout(idle_timeout_s):
                request = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise SessionExpired(
                f"session idle for {idle_timeout_s:g} s: the worker closed it and freed its "
                "KV cache; reopen it with the full history (the worker's "
                "--session-idle-timeout-s sets the limit)"
            ) from None
        yield request


class SessionServicer:
    """The ``Session`` RPC of a worker servicer: each subclass provides the
    worker's sessions (with ``close``) and the translations ``_open`` and
    ``_round``, whose jobs run on ``engine``."""

    def __init__(
        self,
        sessions,
        engine: Engine | InlineEngine,
        *,
        idle_timeout_s: float,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.sessions = sessions
        self.engine = engine
        self.idle_timeout_s = idle_timeout_s
        self.metrics = metrics

    async def Session(self, request_iterator, context):
        async for response in session_stream(
            request_iterator,
            context,
            engine=self.engine,
            on_open=self._open,
            on_round=self._round,
            close=self.sessions.close,
            idle_timeout_s=self.idle_timeout_s,
            metrics=self.metrics,
        ):
            yield response

    def _worker_info(
        self, *, model: str, vocab_size: int, drafter: str = "", hidden_state_layers=()
    ) -> worker_pb2.WorkerInfo:
        """What ``GetWorkerInfo`` answers: the model as the subclass names
        it, and what every worker reports of its sessions and its engine."""
        info = self.sessions.info
        return worker_pb2.WorkerInfo(
            model=model,
            drafter=drafter,
            vocab_size=vocab_size,
            vocab_fingerprint=info.vocab_fingerprint,
            max_context_length=info.max_context,
            active_sessions=len(self.sessions.store),
            cached_tokens=self.sessions.store.cached_tokens,
            device=info.device,
            dtype=info.dtype,
            load=load_to_pb(self.engine.load),
            graphed_tokens_per_row=getattr(self.sessions.runner, "graphed_tokens_per_row", 0),
            hidden_state_layers=hidden_state_layers,
        )
