"""Builds and runs the target worker service."""

from __future__ import annotations

import functools

from outrider import model_specs
from outrider.config import TargetWorkerConfig
from outrider.engine import Engine, InlineEngine
from outrider.engine.build import build_runner
from outrider.grammar import Grammars
from outrider.logging import get_logger
from outrider.rpc import run_service
from outrider.session import SessionStore
from outrider.startup import check_worker
from outrider.target_worker.service import TargetWorkerService
from outrider.target_worker.sessions import TargetInfo, TargetSessions
from outrider.v1 import worker_pb2, worker_pb2_grpc
from outrider.worker import WorkerRole, checkpoint_of, load_model, serve_worker

log = get_logger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name

GRAPH_TOKENS_PER_ROW = 9
"""CUDA graphs cover verify rounds of up to K = 8 drafts; longer ones run eagerly."""


def build_sessions(config: TargetWorkerConfig) -> TargetSessions:
    model, device, dtype = load_model(config)
    info = TargetInfo(
        model_name=config.model or model_specs.DEFAULT_MODEL,
        vocab_size=model.config.vocab_size,
        vocab_fingerprint=model_specs.vocab_fingerprint_of(
            config.model, trust_remote_code=config.trust_remote_code
        ),
        max_context=model_specs.context_length(model),
        device=device,
        dtype=dtype,
    )
    limits = config.limits
    runner = build_runner(
        model,
        limits=limits,
        engine=config.engine,
        max_context=info.max_context,
        checkpoint=checkpoint_of(config),
        trust_remote_code=config.trust_remote_code,
    )
    store = SessionStore(max_sessions=limits.max_sessions, pool=runner.pool)
    grammars = Grammars.of_checkpoint(
        config.model, info.vocab_size, trust_remote_code=config.trust_remote_code
    )
    return TargetSessions(runner, store, info, grammars)


async def warm_up(target: TargetSessions, engine: Engine | InlineEngine) -> None:
    """Captures the CUDA graphs (on CUDA), then runs one short session end
    to end, so the first request pays no start-up cost."""
    await engine.run(
        functools.partial(
            target.runner.warm_up,
            max_rows=target.store.max_sessions,
            max_tokens_per_row=GRAPH_TOKENS_PER_ROW,
        )
    )
    await engine.run(target.open, "warmup", [0, 1, 2, 3])
    await engine.run(target.verify, "warmup", 4, [4, 5, 6])
    await engine.run(target.close, "warmup")


async def serve(config: TargetWorkerConfig) -> None:
    log.info(
        "loading target model",
        model=config.model or model_specs.DEFAULT_MODEL,
        device=config.engine.device,
        dtype=config.engine.dtype,
    )
    await serve_worker(ROLE, config)


ROLE = WorkerRole(
    name="target",
    service_name=SERVICE_NAME,
    build_sessions=build_sessions,
    warm_up=warm_up,
    servicer=TargetWorkerService,
    add_to_server=worker_pb2_grpc.add_TargetWorkerServicer_to_server,
)


def main(config: TargetWorkerConfig) -> None:
    check_worker(config)
    run_service(serve(config))
