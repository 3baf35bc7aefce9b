"""The thread that runs a worker's engine.

Every engine call (open, round, close) runs on this one thread, in order of
submission: the model and the session store are only ever touched from it,
so a session is never freed while a forward pass is using its cache, and the
gRPC event loop never blocks on a forward pass.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import torch

from outrider.config import ServiceAddress
from outrider.rpc import serve_until_signalled, start_server

T = TypeVar("T")


class EngineThread:
    def __init__(self, *, torch_threads: int | None = None) -> None:
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="engine",
            initializer=_init_thread,
            initargs=(torch_threads,),
        )

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Runs ``fn(*args)`` on the engine thread with the caller's log context."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._executor, context.run, fn, *args)

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Queues ``fn(*args)`` without waiting (safe from a cancelled task's cleanup)."""
        self._executor.submit(contextvars.copy_context().run, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


def _init_thread(torch_threads: int | None) -> None:
    if torch_threads:
        torch.set_num_threads(torch_threads)


async def serve_worker(
    address: ServiceAddress,
    *,
    threads: int,
    build_engine: Callable[[], Any],
    warm_up: Callable[[Any], None],
    add_servicer: Callable[[Any, EngineThread, grpc.aio.Server], None],
    service_name: str,
) -> None:
    """Runs a worker: builds its engine on the engine thread, serves it, flips
    health to SERVING after one warm-up session, drains on SIGTERM."""
    thread = EngineThread(torch_threads=threads)
    try:
        engine = await thread.run(build_engine)
        running = await start_server(
            lambda server: add_servicer(engine, thread, server),
            [service_name],
            host=address.host,
            port=address.port,
            credentials=address.tls.credentials() if address.tls else None,
        )
        await serve_until_signalled(
            running, warmup=lambda: thread.run(warm_up, engine), ready_file=address.ready_file
        )
    finally:
        thread.shutdown()
