"""Builds and runs the draft worker service."""

from __future__ import annotations

import functools

from draft_worker.service import DraftWorkerService
from draft_worker.sessions import DraftInfo, DraftSessions
from outrider import models
from outrider.config import DraftWorkerConfig
from outrider.drafters import (
    Drafter,
    EarlyExitDrafter,
    Int4Drafter,
    ModelDrafter,
)
from outrider.engine import Engine, InlineEngine
from outrider.engine.build import build_runner
from outrider.logging import get_logger
from outrider.rpc import run_service
from outrider.session import SessionStore
from outrider.startup import check_worker
from outrider.v1 import worker_pb2, worker_pb2_grpc
from outrider.worker import WorkerRole, checkpoint_of, load_model, serve_worker

log = get_logger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name

GRAPH_TOKENS_PER_ROW = 17
"""CUDA graphs cover draft steps (1 token), syncs after a full accept (2),
and syncs after the target-only rounds between two of adaptive K's probes
(about 10): a sync past the graphs runs eagerly, many times slower."""


def build_sessions(config: DraftWorkerConfig) -> DraftSessions:
    drafter: Drafter
    limits, kind = config.limits, config.drafter_kind
    model, device, dtype = load_model(config, num_layers=config.draft_layers)
    info = DraftInfo(
        vocab_fingerprint=models.vocab_fingerprint_of(
            config.model, trust_remote_code=config.trust_remote_code
        ),
        max_context=models.context_length(model),
        max_draft_tokens=config.max_draft_tokens,
        device=device,
        dtype=dtype,
    )
    int4 = kind == "int4"
    runner = build_runner(
        model,
        limits=limits,
        engine=config.engine,
        max_context=info.max_context,
        int4_group_size=config.int4_group_size if int4 else None,
        checkpoint=checkpoint_of(config),
        num_layers=config.draft_layers,
        trust_remote_code=config.trust_remote_code,
    )
    name = config.model or models.DEFAULT_MODEL
    if kind == "early-exit":
        drafter = EarlyExitDrafter(runner, model_name=f"{name}[:{config.draft_layers}]")
    elif int4:
        drafter = Int4Drafter(runner, model_name=f"{name}[int4-g{config.int4_group_size}]")
    else:
        drafter = ModelDrafter(runner, model_name=name)
    return DraftSessions(
        drafter, SessionStore(max_sessions=limits.max_sessions, pool=runner.pool), info
    )


async def warm_up(draft: DraftSessions, engine: Engine | InlineEngine) -> None:
    """Captures the CUDA graphs (on CUDA), then runs one short session end to end."""
    await engine.run(
        functools.partial(
            draft.runner.warm_up,
            max_rows=draft.store.max_sessions,
            max_tokens_per_row=GRAPH_TOKENS_PER_ROW,
        )
    )
    await engine.run(draft.open, "warmup", [0, 1, 2, 3], 0, "")
    await engine.run(draft.propose, "warmup", 5, [0], min(3, draft.info.max_draft_tokens))
    await engine.run(draft.close, "warmup")


async def serve(config: DraftWorkerConfig) -> None:
    log.info(
        "loading drafter",
        drafter=config.drafter_kind,
        model=config.model,
        device=config.engine.device,
        dtype=config.engine.dtype,
    )
    await serve_worker(ROLE, config)


ROLE = WorkerRole(
    name="draft",
    service_name=SERVICE_NAME,
    build_sessions=build_sessions,
    warm_up=warm_up,
    servicer=DraftWorkerService,
    add_to_server=worker_pb2_grpc.add_DraftWorkerServicer_to_server,
)


def main(config: DraftWorkerConfig) -> None:
    check_worker(config)
    run_service(serve(config))
