"""Builds and runs the draft worker service."""

from __future__ import annotations

import functools

import torch
from transformers import AutoConfig

from outrider import models
from outrider.config import DraftWorkerConfig
from outrider.device import resolve_device, resolve_dtype
from outrider.draft_worker.service import DraftWorkerService
from outrider.draft_worker.sessions import DraftInfo, DraftSessions
from outrider.drafters import (
    Drafter,
    EarlyExitDrafter,
    GgufDrafter,
    Int4Drafter,
    ModelDrafter,
)
from outrider.eagle.drafter import EagleDrafter
from outrider.eagle.features import pack
from outrider.eagle.forward import EagleForward, check_head, target_embeddings
from outrider.eagle.head import load_head, shipped_head
from outrider.engine import Engine, InlineEngine
from outrider.engine.build import build_runner
from outrider.engine.kv_cache import BlockPool
from outrider.engine.runner import PagedRunner
from outrider.grammar import Grammars
from outrider.hidden_states import HiddenStates
from outrider.logging import get_logger
from outrider.prefix import BLOCK_SIZE
from outrider.rpc import run_service
from outrider.sampling_params import SamplingParams
from outrider.session import SessionStore
from outrider.startup import StartupError, check_gguf, check_worker, first_line
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
    if kind == "eagle":
        return eagle_sessions(config)
    if kind == "gguf":
        return gguf_sessions(config)
    model, device, dtype = load_model(config, num_layers=config.draft_layers)
    info = draft_info(config, max_context=models.context_length(model), device=device, dtype=dtype)
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
    store = SessionStore(max_sessions=limits.max_sessions, pool=runner.pool)
    return DraftSessions(drafter, store, info, grammars_of(config, drafter.vocab_size))


def grammars_of(config: DraftWorkerConfig, vocab_size: int) -> Grammars:
    """Structured output's, for the checkpoint's tokenizer."""
    return Grammars.of_checkpoint(
        config.model, vocab_size, trust_remote_code=config.trust_remote_code
    )


def eagle_sessions(config: DraftWorkerConfig) -> DraftSessions:
    """An EAGLE-3 head's sessions: the head (``--head``, else the one shipped
    for the target) over a paged cache of its one layer, reading the
    target's embeddings from its checkpoint."""
    target = models.checkpoint_dir(config.model)
    target_config = AutoConfig.from_pretrained(target)
    head_dir = config.head or shipped_head(config.model)
    if head_dir is None:
        raise StartupError(
            "--head",
            "(none)",
            f"no EAGLE-3 head is shipped for {config.model or models.DEFAULT_MODEL}: train one "
            "(outrider draft train) and pass its directory",
        )
    device = resolve_device(config.engine.device)
    dtype = resolve_dtype(config.engine.dtype, device)
    try:
        head = load_head(head_dir, target_num_layers=target_config.num_hidden_layers)
        check_head(head.config, target_config)
        embed = target_embeddings(target)
    except (OSError, ValueError, KeyError) as exc:
        raise StartupError("--head", str(head_dir), first_line(exc)) from None
    forward = EagleForward(head, embed, dtype=dtype, device=device)
    max_context = min(models.context_length(target_config), forward.max_positions)
    tokens = config.limits.max_cached_tokens or config.limits.max_sessions * max_context
    # No prefix cache: a head's KV at a position depends on the target's
    # features of it, and an EAGLE session is opened on those of every position.
    runner = PagedRunner(forward, BlockPool(max(1, tokens // BLOCK_SIZE), BLOCK_SIZE))
    info = draft_info(
        config, max_context=max_context, device=str(device), dtype=str(dtype).removeprefix("torch.")
    )
    drafter = EagleDrafter(runner, model_name=f"{config.model or models.DEFAULT_MODEL}[eagle3]")
    store = SessionStore(max_sessions=config.limits.max_sessions, pool=runner.pool)
    return DraftSessions(drafter, store, info, grammars_of(config, drafter.vocab_size))


def draft_info(
    config: DraftWorkerConfig,
    *,
    max_context: int,
    device: str,
    dtype: str,
    fingerprint: str | None = None,
) -> DraftInfo:
    """What the worker tells the coordinator of itself; its vocabulary's
    fingerprint is its checkpoint's unless given (a GGUF's own)."""
    if fingerprint is None:
        fingerprint = models.vocab_fingerprint_of(
            config.model, trust_remote_code=config.trust_remote_code
        )
    return DraftInfo(
        vocab_fingerprint=fingerprint,
        max_context=max_context,
        max_draft_tokens=config.max_draft_tokens,
        device=device,
        dtype=dtype,
    )


def gguf_sessions(config: DraftWorkerConfig) -> DraftSessions:
    """A GGUF file's sessions on llama.cpp (``--model``: the file, a
    directory holding one, or an embedded model, whose GGUF the fetch kept):
    one context of ``--max-sessions`` sequences over ``--max-cached-tokens``
    cells, run on ``--threads`` threads."""
    from outrider import gguf_files
    from outrider.engine.gguf_runner import GgufRunner, LlamaCppMissing, llama_cpp

    path = check_gguf("--model", config.model)
    limits = config.limits
    if limits.max_sessions > (most := llama_cpp().llama_max_parallel_sequences()):
        raise StartupError(
            "--max-sessions",
            limits.max_sessions,
            f"llama.cpp runs at most {most} sequences in one context: give {most} or fewer",
        )
    try:
        runner = GgufRunner.load(
            path,
            max_sessions=limits.max_sessions,
            max_cached_tokens=limits.max_cached_tokens,
            threads=config.engine.threads,
        )
    except LlamaCppMissing as exc:
        raise StartupError("--drafter", "gguf", str(exc)) from None
    except ValueError as exc:
        raise StartupError("--model", str(path), str(exc)) from None
    info = draft_info(
        config,
        max_context=runner.info.context_length,
        device="cpu",
        dtype=runner.info.description.rsplit(" ", 1)[-1],
        fingerprint=gguf_files.vocab_fingerprint(path),
    )
    drafter = GgufDrafter(runner, model_name=path.name)
    store = SessionStore(max_sessions=limits.max_sessions, pool=runner.pool)

    grammars = Grammars.loading(lambda: gguf_files.load_tokenizer(path), runner.vocab_size)
    return DraftSessions(drafter, store, info, grammars)


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
