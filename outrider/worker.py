"""Running a worker service (draft or target): its engine, its gRPC server,
its metrics, its warm-up, its drain on SIGTERM."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from outrider.config import EngineConfig, ServiceAddress
from outrider.engine import Engine, InlineEngine
from outrider.logging import get_logger
from outrider.metrics import RpcMetrics, WorkerMetrics, serving_metrics
from outrider.rpc import serve_until_signalled, start_server

log = get_logger(__name__)


def start_engine(worker: Any, config: EngineConfig, *, max_rows: int, on_step=None) -> Engine | InlineEngine:
    """The engine that runs ``worker``'s jobs: a batching :class:`Engine` on
    its own thread, or, for a worker without a model, an :class:`InlineEngine`."""
    runner = worker.runner
    if runner is None:
        return InlineEngine()
    return Engine(
        runner,
        max_tokens_per_step=config.tokens_per_step(runner.device.type),
        max_rows=max_rows,
        torch_threads=config.threads,
        on_step=on_step,
    )


async def serve_worker(
    address: ServiceAddress,
    config: EngineConfig,
    *,
    build: Callable[[], Any],
    warm_up: Callable[[Any, Engine | InlineEngine], Awaitable[None]],
    add_servicer: Callable[[Any, Engine | InlineEngine, grpc.aio.Server, WorkerMetrics | None], None],
    service_name: str,
    role: str,
    max_sessions: int,
) -> None:
    """Runs a worker (``role``: draft or target): loads it with ``build``
    (off the event loop), starts its engine, serves its metrics when it has
    a metrics port, serves it, flips health to SERVING after ``warm_up``,
    drains on SIGTERM."""
    with serving_metrics(address) as endpoint:
        worker = await asyncio.to_thread(build)
        metrics = WorkerMetrics(endpoint.registry, worker.store, role=role) if endpoint else None
        engine = start_engine(worker, config, max_rows=max_sessions, on_step=metrics.step if metrics else None)
        info = worker.info
        log.info("worker ready to warm up", role=role, device=info.device, dtype=info.dtype, runner=type(worker.runner).__name__)
        try:
            running = await start_server(
                lambda server: add_servicer(worker, engine, server, metrics),
                [service_name],
                host=address.host,
                port=address.port,
                credentials=address.tls.credentials() if address.tls else None,
                metrics=RpcMetrics(endpoint.registry) if endpoint else None,
            )
            await serve_until_signalled(
                running,
                warmup=lambda: warm_up(worker, engine),
                ready_file=address.ready_file,
                grace_s=address.shutdown_grace_s,
            )
        finally:
            engine.shutdown()
