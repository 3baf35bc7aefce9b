"""Builds and runs the target worker service."""

from __future__ import annotations

import torch

from outrider import models
from outrider.config import TargetWorkerConfig
from outrider.engine_thread import serve_worker
from outrider.logging import get_logger
from outrider.memory import worker_cache_budget
from outrider.rpc import run_service
from outrider.runner import ModelRunner
from outrider.session import SessionStore
from outrider.v1 import worker_pb2, worker_pb2_grpc
from target_worker.engine import TargetEngine, TargetInfo
from target_worker.service import TargetWorkerService

log = get_logger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name


def build_engine(config: TargetWorkerConfig) -> TargetEngine:
    model = models.load_causal_lm(
        config.model, dtype=getattr(torch, config.dtype), trust_remote_code=config.trust_remote_code
    )
    info = TargetInfo(
        model_name=config.model or models.DEFAULT_MODEL,
        vocab_size=model.config.vocab_size,
        vocab_fingerprint=models.vocab_fingerprint_of(config.model, trust_remote_code=config.trust_remote_code),
        max_context=models.context_length(model),
    )
    limits = config.limits
    store = SessionStore(
        max_sessions=limits.max_sessions,
        max_cached_tokens=worker_cache_budget(
            model,
            max_sessions=limits.max_sessions,
            max_context=info.max_context,
            max_cached_tokens=limits.max_cached_tokens,
        ),
    )
    return TargetEngine(ModelRunner(model), store, info)


def warm_up(engine: TargetEngine) -> None:
    """One short session end to end, so the first request pays no start-up cost."""
    engine.open("warmup", [0, 1, 2, 3])
    engine.verify("warmup", 4, [4, 5, 6])
    engine.close("warmup")


async def serve(config: TargetWorkerConfig) -> None:
    log.info("loading target model", model=config.model or models.DEFAULT_MODEL, dtype=config.dtype)
    await serve_worker(
        config.address,
        threads=config.threads,
        build_engine=lambda: build_engine(config),
        warm_up=warm_up,
        add_servicer=lambda engine, thread, server, metrics: worker_pb2_grpc.add_TargetWorkerServicer_to_server(
            TargetWorkerService(engine, thread, idle_timeout_s=config.limits.session_idle_timeout_s, metrics=metrics), server
        ),
        service_name=SERVICE_NAME,
        role="target",
    )


def main(config: TargetWorkerConfig) -> None:
    run_service(serve(config))
