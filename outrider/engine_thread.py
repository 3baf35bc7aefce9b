"""The thread that runs a worker's engine.

Every engine call (open, round, close) runs on this one thread, in order of
submission: the model and the session store are only ever touched from it,
so a session is never freed while a forward pass is using its cache, and the
gRPC event loop never blocks on a forward pass.

The hop is a bare queue and one ``call_soon_threadsafe`` back: a round trip
through ``run_in_executor`` costs about 170 µs on loopback-sized work, this
about half. An engine that never runs a model (prompt lookup) needs no thread
at all: :class:`InlineEngine` calls it on the event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import torch

from outrider.config import ServiceAddress
from outrider.logging import get_logger
from outrider.metrics import RpcMetrics, WorkerMetrics, serving_metrics
from outrider.rpc import serve_until_signalled, start_server

log = get_logger(__name__)
T = TypeVar("T")


class EngineThread:
    def __init__(self, *, torch_threads: int | None = None) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, args=(torch_threads,), name="engine", daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Runs ``fn(*args)`` on the engine thread with the caller's log context."""
        result, _ = await self.timed(fn, *args)
        return result

    async def timed(self, fn: Callable[..., T], *args: object) -> tuple[T, float]:
        """Like :meth:`run`, and the seconds ``fn`` itself took (no hop)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((contextvars.copy_context(), fn, args, loop, future))
        return await future

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Queues ``fn(*args)`` without waiting (safe from a cancelled task's cleanup)."""
        self._calls.put((contextvars.copy_context(), fn, args, None, None))

    def shutdown(self) -> None:
        self._calls.put(None)
        self._thread.join()

    def _serve(self, torch_threads: int | None) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        while (call := self._calls.get()) is not None:
            context, fn, args, loop, future = call
            started = time.perf_counter()
            try:
                outcome = (_set_result, (context.run(fn, *args), time.perf_counter() - started))
            except BaseException as exc:  # handed to the awaiting caller
                outcome = (_set_exception, exc)
            if future is None:
                if outcome[0] is _set_exception:
                    log.error("engine call failed", call=getattr(fn, "__name__", repr(fn)), error=repr(outcome[1]))
                continue
            try:
                loop.call_soon_threadsafe(outcome[0], future, outcome[1])
            except RuntimeError:
                pass  # the loop has closed: nobody is waiting any more


def _set_result(future: asyncio.Future, value: object) -> None:
    if not future.done():  # the caller may have been cancelled meanwhile
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class InlineEngine:
    """The :class:`EngineThread` interface for an engine without a model:
    each call runs at once on the event loop (prompt lookup takes
    microseconds, less than any hop to a thread)."""

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return fn(*args)

    async def timed(self, fn: Callable[..., T], *args: object) -> tuple[T, float]:
        started = time.perf_counter()
        return fn(*args), time.perf_counter() - started

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        fn(*args)

    def shutdown(self) -> None:
        pass


async def serve_worker(
    address: ServiceAddress,
    *,
    threads: int,
    build_engine: Callable[[], Any],
    warm_up: Callable[[Any], None],
    add_servicer: Callable[[Any, EngineThread, grpc.aio.Server, WorkerMetrics | None], None],
    service_name: str,
    role: str,
    inline: bool = False,
) -> None:
    """Runs a worker (``role``: draft or target): serves its metrics when it
    has a metrics port, builds its engine on the engine thread, serves it,
    flips health to SERVING after one warm-up session, drains on SIGTERM.
    ``inline``: the engine runs no model, so it runs on the event loop."""
    thread = InlineEngine() if inline else EngineThread(torch_threads=threads)
    try:
        with serving_metrics(address) as endpoint:
            engine = await thread.run(build_engine)
            metrics = WorkerMetrics(endpoint.registry, engine.store, role=role) if endpoint else None
            running = await start_server(
                lambda server: add_servicer(engine, thread, server, metrics),
                [service_name],
                host=address.host,
                port=address.port,
                credentials=address.tls.credentials() if address.tls else None,
                metrics=RpcMetrics(endpoint.registry) if endpoint else None,
            )
            await serve_until_signalled(
                running,
                warmup=lambda: thread.run(warm_up, engine),
                ready_file=address.ready_file,
                grace_s=address.shutdown_grace_s,
            )
    finally:
        thread.shutdown()
