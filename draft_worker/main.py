"""Builds and runs the draft worker service."""

from __future__ import annotations

import functools

import torch

from outrider.config import DraftWorkerConfig
from outrider.draft_worker.service import DraftWorkerService
from outrider.draft_worker.sessions import DraftSessions
from outrider.drafters import DRAFTERS
from outrider.drafters.model import LoadedDrafter
from outrider.engine import Engine, InlineEngine
from outrider.engine.hidden_states import pack
from outrider.hidden_states import HiddenStates
from outrider.logging import get_logger
from outrider.rpc import run_service
from outrider.sampling_params import SamplingParams
from outrider.session import SessionStore
from outrider.startup import check_worker
from outrider.v1 import worker_pb2, worker_pb2_grpc
from outrider.worker import WorkerRole, serve_worker

log = get_logger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name

GRAPH_TOKENS_PER_ROW = 17
"""CUDA graphs cover draft steps (1 token), syncs after a full accept (2),
and syncs after the target-only rounds between two of adaptive K's probes
(about 10): a sync past the graphs runs eagerly, many times slower."""


def build_sessions(config: DraftWorkerConfig) -> DraftSessions:
    """The sessions of the drafter ``--drafter`` names (:data:`outrider.drafters.DRAFTERS`)."""
    loaded: LoadedDrafter = DRAFTERS[config.drafter_kind].load(config)
    store = SessionStore(max_sessions=config.limits.max_sessions, pool=loaded.drafter.runner.pool)
    return DraftSessions(loaded.drafter, store, loaded.info, loaded.grammars)


async def warm_up(draft: DraftSessions, engine: Engine | InlineEngine) -> None:
    """Captures the CUDA graphs (on CUDA), then runs one short session end to end."""
    await engine.run(
        functools.partial(
            draft.runner.warm_up,
            max_rows=draft.store.max_sessions,
            max_tokens_per_row=GRAPH_TOKENS_PER_ROW,
        )
    )
    forward = getattr(draft.runner, "forward", None)
    width = getattr(forward, "feature_width", 0)  # a head reads the target's

    def features(rows: int) -> HiddenStates | None:
        return pack(torch.zeros(rows, width)) if width else None

    await engine.run(draft.open, "warmup", [0, 1, 2, 3], 0, "", SamplingParams(), features(3))
    await engine.run(
        draft.propose, "warmup", 5, [0], min(3, draft.info.max_draft_tokens), None, features(1)
    )
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
