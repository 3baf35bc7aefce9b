"""What every Outrider service shares at the gRPC edge: the interceptor that
maps domain errors to status codes and binds the request id into the logs,
health (SERVING only after warm-up), reflection, and start/stop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from outrider import errors
from outrider.logging import bind_contextvars, get_logger
from outrider.security import authorized
from outrider.startup import StartupError
from outrider.validation import check_request_id

if TYPE_CHECKING:
    from outrider.metrics import RpcMetrics

log = get_logger(__name__)

STATUS_OF: dict[type[errors.OutriderError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.SessionNotFound: grpc.StatusCode.NOT_FOUND,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.SessionExpired: grpc.StatusCode.ABORTED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}

# Probes and tools reach these without a token.
PUBLIC_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

REQUEST_ID_KEY = "x-request-id"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
CHANNEL_OPTIONS: Sequence[tuple[str, Any]] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


def status_of(exc: errors.OutriderError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL


def error_from_status(code: grpc.StatusCode, message: str) -> errors.OutriderError:
    """The domain error a peer's status stands for (UNAVAILABLE for anything
    that is not a refusal of the request itself)."""
    for cls, status in STATUS_OF.items():
        if status == code:
            return cls(message)
    return errors.Unavailable(f"{message} ({code.name})")


def parsing(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """``deserializer`` (None: the bytes as they are) with bytes that do not
    parse (a corrupt wire format, invalid UTF-8 in a string) refused as the
    client's mistake: InvalidArgument."""

    def parse(raw: bytes) -> Any:
        if deserializer is None:
            return raw
        try:
            return deserializer(raw)
        except DecodeError as exc:
            raise errors.InvalidArgument(f"the request could not be parsed: {exc}") from None

    return parse


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Binds the call's request id into structlog, turns a domain error into
    its status code, and any other exception into INTERNAL without leaking a
    stack trace to the client (it is logged instead); a request that does not
    parse is refused INVALID_ARGUMENT like any other bad request. With
    ``tokens``, every call but health and reflection needs ``authorization:
    Bearer <token>`` (compared in constant time), else UNAUTHENTICATED. With ``metrics``, every
    call is counted by its final status code and timed. Calls are admitted
    through ``drain`` (refused once the server shuts down)."""

    def __init__(
        self,
        tokens: frozenset[str] = frozenset(),
        metrics: RpcMetrics | None = None,
        drain: Drain | None = None,
    ) -> None:
        self._tokens = tokens
        self._metrics = metrics
        self._drain = drain if drain is not None else Drain()

    def _authorize(self, metadata: dict, method: str) -> None:
        if not self._tokens or method.startswith(PUBLIC_SERVICES):
            return
        if not authorized(str(metadata.get("authorization", "")), self._tokens):
            raise errors.Unauthenticated(
                "this service needs a bearer token: send metadata 'authorization: Bearer <token>'"
            )

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        call = _Call.of(handler_call_details)
        # grpc parses a single request before the handler runs, and answers a
        # failure there UNKNOWN, uncounted, with a traceback in the log; so a
        # single request reaches the wrapped handler as bytes and is parsed
        # inside it. A streamed request is parsed as the handler reads it.
        parse = parsing(handler.request_deserializer)
        single = not handler.request_streaming
        guarded = functools.partial(self._guarded, call, parse if single else None)
        return _rewrapped(handler, guarded, request_deserializer=None if single else parse)

    @contextlib.asynccontextmanager
    async def _guarded(
        self,
        call: _Call,
        parse: Callable[[bytes], Any] | None,
        request: Any,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Any]:
        """Around one call's handler: binds its request id into the logs,
        checks its token and request id, parses a single request (with
        ``parse``) and admits it through the drain; yields the request. Maps
        what the handler raises to its status code, and counts the call."""
        bind_contextvars(request_id=call.request_id)
        started, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            self._authorize(call.metadata, call.method)
            if call.sent_request_id:
                check_request_id(call.sent_request_id, what=f"metadata {REQUEST_ID_KEY}")
            if parse is not None:
                request = parse(request)
            with self._drain.admit(call.method):
                yield request
            code = _returned_code(context)
        except Exception as exc:
            code = _code_of(exc, context)
            if _is_abort(exc):
                raise
            await _abort(context, call, exc)
        except (asyncio.CancelledError, GeneratorExit):
            code = _cancelled_code(context)
            raise
        finally:
            if self._metrics:
                self._metrics.observe(call.method, code, time.perf_counter() - started)


@dataclass(frozen=True)
class _Call:
    """What the interceptor knows of a call before its handler runs."""

    method: str
    metadata: dict[str, Any]
    sent_request_id: str | None
    """The client's ``x-request-id``, if it sent one."""
    request_id: str
    """The one bound into the logs: the client's, or a fresh one."""

    @classmethod
    def of(cls, details: grpc.HandlerCallDetails) -> _Call:
        metadata = dict(details.invocation_metadata or ())
        sent = metadata.get(REQUEST_ID_KEY)
        return cls(details.method, metadata, sent, sent or uuid.uuid4().hex[:16])


async def _abort(context: grpc.aio.ServicerContext, call: _Call, exc: Exception) -> None:
    """Ends the call with ``exc``'s status: a domain error's own, else
    INTERNAL, whose details name only the request id (the trace is logged)."""
    if isinstance(exc, errors.OutriderError):
        log.info("request refused", method=call.method, status=status_of(exc).name, error=str(exc))
        await context.abort(status_of(exc), str(exc))
    log.exception("internal error", method=call.method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request id {call.request_id})")


_Guarded = Callable[[Any, grpc.aio.ServicerContext], contextlib.AbstractAsyncContextManager[Any]]
_HANDLER_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


def _rewrapped(
    handler: grpc.RpcMethodHandler,
    guarded: _Guarded,
    request_deserializer: Callable[[bytes], Any] | None,
) -> grpc.RpcMethodHandler:
    """``handler`` with its behavior run inside ``guarded``: one wrapper for a
    single response, one for a stream of them."""

    def single(behavior):
        async def wrapped(request, context):
            async with guarded(request, context) as request:
                return await behavior(request, context)

        return wrapped

    def streamed(behavior):
        async def wrapped(request, context):
            async with guarded(request, context) as request:
                async for response in behavior(request, context):
                    yield response

        return wrapped

    kind, make = next((k, m) for k, m in _HANDLER_KINDS if getattr(handler, k))
    wrap = streamed if kind.endswith("_stream") else single
    return make(
        wrap(getattr(handler, kind)),
        request_deserializer=request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _is_abort(exc: BaseException) -> bool:
    # context.abort() raises this to end the call; it must pass through.
    return isinstance(exc, grpc.aio.AbortError) or type(exc).__name__ == "AbortError"


def _returned_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status a call that returned ends with: OK, unless the handler set another."""
    return context.code() or grpc.StatusCode.OK


def _code_of(exc: Exception, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status a call that raised ``exc`` ends with."""
    if _is_abort(exc):
        return context.code() or grpc.StatusCode.UNKNOWN
    if isinstance(exc, errors.OutriderError):
        return status_of(exc)
    return grpc.StatusCode.INTERNAL


def _cancelled_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """A call cancelled under the servicer: its deadline passed, or the client went away."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


class Drain:
    """A server's calls in flight, and the switch that makes it refuse new
    ones while those finish (graceful shutdown). Health and reflection are
    neither counted nor refused: probes keep getting their answer."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def admit(self, method: str) -> Iterator[None]:
        """Counts the call while it runs; UNAVAILABLE once draining."""
        if method.startswith(PUBLIC_SERVICES):
            yield
            return
        if self.draining:
            service = method.strip("/").split("/")[0]
            raise errors.Unavailable(
                f"{service} is shutting down and takes no new calls: retry on another replica"
            )
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    async def drain(self, grace_s: float) -> bool:
        """Refuses new calls from now on; True once none is in flight, False
        if some still are after ``grace_s`` seconds."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            return False
        return True


@dataclass
class RunningServer:
    """A started service: its server, health servicer, bound port and drain."""

    server: grpc.aio.Server
    health: HealthServicer
    port: int
    service_names: tuple[str, ...]
    drain: Drain

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)

    async def shutdown(self, grace_s: float) -> None:
        """Graceful stop: NOT_SERVING, new calls refused with UNAVAILABLE (a
        coordinator opens its new sessions on another replica, a client
        retries elsewhere), calls in flight given ``grace_s`` seconds to
        finish; those still running then are cancelled (a coordinator
        reopens their sessions elsewhere, from its history)."""
        await self.set_serving(False)
        log.info("draining", grace_s=grace_s, in_flight=self.drain.in_flight)
        if not await self.drain.drain(grace_s):
            log.warning(
                "grace period over: cancelling the calls still in flight",
                in_flight=self.drain.in_flight,
            )
        await self.server.stop(None)


async def start_server(
    add_servicers: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    credentials: grpc.ServerCredentials | None = None,
    tokens: frozenset[str] = frozenset(),
    metrics: RpcMetrics | None = None,
) -> RunningServer:
    """Starts a service that reports NOT_SERVING until ``set_serving(True)``;
    TLS when ``credentials`` is given, bearer tokens required when ``tokens`` is,
    every call counted in ``metrics`` when given."""
    drain = Drain()
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(tokens, metrics, drain)], options=list(CHANNEL_OPTIONS)
    )
    add_servicers(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [
            *service_names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    address = f"{host}:{port}"
    try:
        bound = (
            server.add_secure_port(address, credentials)
            if credentials
            else server.add_insecure_port(address)
        )
    except RuntimeError:  # grpc says no more than that it failed
        bound = 0
    if bound == 0:
        raise StartupError(
            "--port",
            port,
            f"cannot listen on {host}:{port}: the port is taken, or --host is not an address "
            "of this machine",
        )
    await server.start()
    running = RunningServer(
        server=server, health=health, port=bound, service_names=tuple(service_names), drain=drain
    )
    await running.set_serving(False)
    return running


def run_service(main: Coroutine[Any, Any, None]) -> None:
    """Runs a service's main coroutine on uvloop when it is installed (a gRPC
    round trip on loopback is faster there, docs/benchmark.md#overhead-per-round),
    else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def freeze_startup_heap() -> int:
    """Collects, then moves every object alive after start-up (modules, the
    model, the tokenizer) where the garbage collector no longer walks, as
    vLLM's ``freeze_gc_heap`` does after its warm-up; returns how many. A
    full collection then walks only what serving allocated: one that walked
    a coordinator's start-up heap stopped its every stream for 52–73 ms
    (docs/benchmark.md#overhead-per-round)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def serve_until_signalled(
    running: RunningServer,
    *,
    warmup: Callable[[], Awaitable[None]] | None = None,
    ready_file: Path | None = None,
    grace_s: float = 10.0,
    until: Awaitable[object] | None = None,
) -> None:
    """Warms up, flips health to SERVING, writes the bound port to
    ``ready_file``, and on SIGTERM/SIGINT (or once ``until`` is done) shuts
    down gracefully (:meth:`RunningServer.shutdown`) within ``grace_s`` seconds."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if warmup is not None:
        await warmup()
    frozen = freeze_startup_heap()
    await running.set_serving(True)
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(str(running.port))
        tmp.replace(ready_file)
    log.info(
        "serving", port=running.port, services=list(running.service_names), frozen_objects=frozen
    )
    signalled = asyncio.ensure_future(stop.wait())
    waits = {signalled} if until is None else {signalled, asyncio.ensure_future(until)}
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()  # (``until`` is the caller's: left as it is)
    await running.shutdown(grace_s)
