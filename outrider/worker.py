"""Running a worker service (draft or target): its sessions and engine, its
gRPC server, its metrics, its warm-up, its drain on SIGTERM."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from outrider import model_specs
from outrider.config import EngineConfig
from outrider.device import resolve_device, resolve_dtype
from outrider.engine import Engine, InlineEngine
from outrider.engine.causal_lm import load_causal_lm
from outrider.logging import get_logger
from outrider.memory import return_freed_memory
from outrider.metrics import RpcMetrics, WorkerMetrics, serving_metrics
from outrider.rpc import serve_until_signalled, start_server
from outrider.startup import StartupError, first_line

log = get_logger(__name__)

AnyEngine = Engine | InlineEngine


def load_model(config: Any, *, num_layers: int | None = None) -> tuple[Any, str, str]:
    """The worker's model (``config.model``, cut to ``num_layers``) on its
    engine's device and dtype, and their names as the worker reports them.
    A tensor-parallel worker's model is its architecture only, on the meta
    device: each rank reads its own shard of the weights
    (:mod:`outrider.engine.parallel`)."""
    device = resolve_device(config.engine.device)
    dtype = resolve_dtype(config.engine.dtype, device)
    try:
        if config.engine.tensor_parallel_size > 1:
            from outrider.engine.parallel import meta_model

            model = meta_model(
                model_specs.checkpoint_dir(config.model),
                num_layers=num_layers,
                trust_remote_code=config.trust_remote_code,
            )
            return model, str(device), str(dtype).removeprefix("torch.")
        model = load_causal_lm(
            config.model,
            dtype=dtype,
            device=device,
            num_layers=num_layers,
            trust_remote_code=config.trust_remote_code,
        )
    except Exception as exc:  # whatever the checkpoint's loader raises: it does not load here
        raise StartupError(
            "--model",
            config.model or model_specs.DEFAULT_MODEL,
            f"does not load: {type(exc).__name__}: {first_line(exc)}",
        ) from None
    return model, str(device), str(dtype).removeprefix("torch.")


def checkpoint_of(config: Any) -> str | None:
    """Where a tensor-parallel worker's ranks read their shards; None for one rank."""
    if config.engine.tensor_parallel_size == 1:
        return None
    return model_specs.checkpoint_dir(config.model)


def start_engine(sessions: Any, config: EngineConfig, *, max_rows: int, on_step=None) -> Engine:
    """The engine that runs ``sessions``' jobs in this process: a batching
    :class:`Engine` on its own thread."""
    runner = sessions.runner
    engine = Engine(
        runner,
        max_tokens_per_step=config.tokens_per_step(runner.device.type),
        max_prefill_tokens=config.prefill_tokens(runner.device.type),
        max_rows=max_rows,
        torch_threads=rank_threads(config),
        max_batch_wait=config.max_batch_wait,
        on_step=on_step,
    )
    if (watch := getattr(getattr(runner, "forward", None), "watch", None)) is not None:
        watch(engine.fail)  # a tensor-parallel rank that exits stops the engine
    return engine


def rank_threads(config: EngineConfig) -> int:
    """Torch threads of each rank: ``--threads`` shared among the tensor-parallel ranks."""
    return max(1, config.threads // config.tensor_parallel_size)


@dataclass(frozen=True)
class WorkerRole:
    """What makes a worker a draft or a target worker; each worker package
    defines one (``outrider.draft_worker.main.ROLE``, ``outrider.target_worker.main.ROLE``)."""

    name: str
    """draft or target"""
    service_name: str
    """Its gRPC service's full name (health, reflection)."""
    build_sessions: Callable[[Any], Any]
    """The worker's sessions (and their model runner) from its config."""
    warm_up: Callable[[Any, AnyEngine], Awaitable[None]]
    """Runs once before the worker reports SERVING."""
    servicer: Callable[..., Any]
    """Its gRPC servicer class (an ``outrider.session_stream.SessionServicer``)."""
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    """The generated ``add_…Servicer_to_server``."""

    def add_servicer(
        self,
        server: grpc.aio.Server,
        sessions: Any,
        engine: AnyEngine,
        *,
        idle_timeout_s: float,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        servicer = self.servicer(sessions, engine, idle_timeout_s=idle_timeout_s, metrics=metrics)
        self.add_to_server(servicer, server)


async def open_worker(
    role: WorkerRole, config: Any, *, on_step: Callable | None = None
) -> tuple[Any, AnyEngine, Callable[[], Awaitable[None]]]:
    """The sessions ``role`` builds from ``config`` (the model loads off the
    event loop), the engine that runs their jobs, and their warm-up.

    The engine runs in this process, on a thread of its own, rather than in
    a process of its own behind ZeroMQ as vLLM's engine core: the calls'
    pickling and hops cost more than the interpreter time they would save
    the gRPC threads (docs/benchmark.md#a-steps-cost)."""
    sessions = await asyncio.to_thread(_single_threaded, role.build_sessions, config)
    return_freed_memory()
    engine = start_engine(
        sessions, config.engine, max_rows=config.limits.max_sessions, on_step=on_step
    )

    async def warm_up() -> None:
        await role.warm_up(sessions, engine)
        if isinstance(engine, Engine):
            engine.meter.reset()  # cold steps say nothing of the steps to come

    return sessions, engine, warm_up


def _single_threaded(build: Callable[[Any], Any], config: Any) -> Any:
    """``build(config)`` with one torch thread, on a thread that outlives
    it. A thread that once ran torch's parallel loops keeps its OpenMP
    team, and an idle team elsewhere slowed every parallel op of the
    engine's thread: a decode step took about twice as long
    (docs/benchmark.md#a-steps-cost)."""
    torch.set_num_threads(1)
    return build(config)


async def serve_worker(role: WorkerRole, config: Any) -> None:
    """Runs a worker (see :func:`open_worker`): serves its metrics when it
    has a metrics port, serves it, flips health to SERVING after its
    warm-up, drains on SIGTERM."""
    service = config.service
    metrics: WorkerMetrics | None = None

    def on_step(stats) -> None:
        if metrics is not None:
            metrics.step(stats)

    with serving_metrics(service) as endpoint:
        sessions, engine, warm_up = await open_worker(role, config, on_step=on_step)
        info = sessions.info
        log.info(
            "worker loaded",
            role=role.name,
            device=info.device,
            dtype=info.dtype,
            engine=type(engine).__name__,
            pid=os.getpid(),
        )
        try:
            if endpoint:
                metrics = WorkerMetrics(endpoint.registry, sessions.store, role=role.name)
            running = await start_server(
                lambda server: role.add_servicer(
                    server,
                    sessions,
                    engine,
                    idle_timeout_s=config.limits.session_idle_timeout_s,
                    metrics=metrics,
                ),
                [role.service_name],
                host=service.host,
                port=service.port,
                credentials=tls.credentials() if (tls := service.tls) else None,
                metrics=RpcMetrics(endpoint.registry) if endpoint else None,
            )
            # A worker whose engine loop died stops (health NOT_SERVING, exit
            # status 1) for its supervisor to restart, as vLLM's server does.
            exited = asyncio.wrap_future(engine.exited) if isinstance(engine, Engine) else None
            await serve_until_signalled(
                running,
                warmup=warm_up,
                ready_file=service.ready_file,
                grace_s=service.shutdown_grace_s,
                until=exited,
            )
            if exited is not None and exited.done() and (failure := exited.result()) is not None:
                raise RuntimeError("the worker's engine loop failed") from failure
        finally:
            engine.shutdown()
            if (close := getattr(sessions.runner, "close", None)) is not None:
                close()  # stops a tensor-parallel worker's other ranks
