"""Builds and runs the draft worker service."""

from __future__ import annotations

import torch

from draft_worker.engine import DraftEngine, DraftInfo
from draft_worker.service import DraftWorkerService
from outrider import models
from outrider.config import DraftWorkerConfig
from outrider.drafters import Drafter, EarlyExitDrafter, ModelDrafter, PromptLookupDrafter
from outrider.engine_thread import serve_worker
from outrider.logging import get_logger
from outrider.memory import worker_cache_budget
from outrider.rpc import run_service
from outrider.runner import ModelRunner
from outrider.session import SessionStore
from outrider.v1 import worker_pb2, worker_pb2_grpc

log = get_logger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name

# Model-free drafters work with any vocabulary and any context length.
UNBOUNDED_CONTEXT = 1 << 30


def build_engine(config: DraftWorkerConfig) -> DraftEngine:
    drafter: Drafter
    if config.drafter == "prompt-lookup":
        drafter = PromptLookupDrafter(max_ngram=config.max_ngram)
        fingerprint, max_context = "", UNBOUNDED_CONTEXT
    else:
        model = models.load_causal_lm(
            config.model,
            dtype=getattr(torch, config.dtype),
            num_layers=config.draft_layers,
            trust_remote_code=config.trust_remote_code,
        )
        fingerprint = models.vocab_fingerprint_of(config.model, trust_remote_code=config.trust_remote_code)
        max_context = models.context_length(model)
        name = config.model or models.DEFAULT_MODEL
        if config.drafter == "early-exit":
            drafter = EarlyExitDrafter(ModelRunner(model), model_name=f"{name}[:{config.draft_layers}]")
        else:
            drafter = ModelDrafter(ModelRunner(model), model_name=name)
    limits = config.limits
    if drafter.runner is None:
        # Model-free: sessions keep no KV cache, so the budget is never consulted.
        max_cached_tokens = limits.max_cached_tokens or 0
    else:
        max_cached_tokens = worker_cache_budget(
            drafter.runner.model,
            max_sessions=limits.max_sessions,
            max_context=max_context,
            max_cached_tokens=limits.max_cached_tokens,
        )
    store = SessionStore(max_sessions=limits.max_sessions, max_cached_tokens=max_cached_tokens)
    info = DraftInfo(
        vocab_fingerprint=fingerprint, max_context=max_context, max_draft_tokens=config.max_draft_tokens
    )
    return DraftEngine(drafter, store, info)


def warm_up(engine: DraftEngine) -> None:
    engine.open("warmup", [0, 1, 2, 3], 0, "")
    engine.propose("warmup", 5, [0], min(3, engine.info.max_draft_tokens))
    engine.close("warmup")


async def serve(config: DraftWorkerConfig) -> None:
    log.info("loading drafter", drafter=config.drafter, model=config.model, dtype=config.dtype)
    await serve_worker(
        config.address,
        threads=config.threads,
        build_engine=lambda: build_engine(config),
        warm_up=warm_up,
        add_servicer=lambda engine, thread, server, metrics: worker_pb2_grpc.add_DraftWorkerServicer_to_server(
            DraftWorkerService(engine, thread, idle_timeout_s=config.limits.session_idle_timeout_s, metrics=metrics), server
        ),
        service_name=SERVICE_NAME,
        role="draft",
        inline=config.drafter == "prompt-lookup",
    )


def main(config: DraftWorkerConfig) -> None:
    run_service(serve(config))
