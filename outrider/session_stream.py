"""The worker side of a session stream, shared by both workers.

One bidirectional stream is one session: the first request opens it, each
later request is one round, and when the stream ends — completed, cancelled,
deadline, coordinator gone — the session and its KV cache are freed at once.
Session lifetime is stream lifetime: nothing can leak, so no collector of
orphans is needed.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from outrider.engine_thread import EngineThread
from outrider.errors import FailedPrecondition, InvalidArgument
from outrider.logging import bind_contextvars, get_logger

log = get_logger(__name__)
Response = TypeVar("Response")


async def session_stream(
    requests: AsyncIterable[Any],
    *,
    thread: EngineThread,
    on_open: Callable[[str, Any], Awaitable[Response]],
    on_round: Callable[[str, Any], Awaitable[Response]],
    close: Callable[[str], None],
) -> AsyncIterator[Response]:
    session_id = uuid.uuid4().hex[:16]
    bind_contextvars(session_id=session_id)
    opened = False
    try:
        async for request in requests:
            kind = request.WhichOneof("kind")
            if kind == "open":
                if opened:
                    raise InvalidArgument("the session is already open: later messages must be rounds")
                if request.open.request_id:
                    bind_contextvars(request_id=request.open.request_id)
                response = await on_open(session_id, request.open)
                opened = True
                log.debug("session opened", committed_len=len(request.open.token_ids))
                yield response
            elif kind == "round":
                if not opened:
                    raise FailedPrecondition("the first message of a session must open it")
                yield await on_round(session_id, request.round)
            else:
                raise InvalidArgument("each session message must set either 'open' or 'round'")
    finally:
        # Queued behind any forward pass still running for this session.
        thread.submit(close, session_id)
        log.debug("session closed")


class SessionServicer:
    """The ``Session`` RPC of a worker servicer: each subclass provides the
    engine (with ``close``) and the translations ``_open`` and ``_round``."""

    def __init__(self, engine, thread: EngineThread) -> None:
        self.engine = engine
        self.thread = thread

    async def Session(self, request_iterator, context):
        async for response in session_stream(
            request_iterator,
            thread=self.thread,
            on_open=self._open,
            on_round=self._round,
            close=self.engine.close,
        ):
            yield response
