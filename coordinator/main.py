"""Builds and runs the coordinator service."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from outrider import model_specs
from outrider.config import CoordinatorConfig, http_port_file
from outrider.coordinator.metrics import CoordinatorMetrics, SuffixCacheMetrics
from outrider.coordinator.openai import HttpServer, create_app, start_http_server
from outrider.coordinator.requests import SpeculationDefaults
from outrider.coordinator.served_models import Models
from outrider.coordinator.service import CoordinatorService
from outrider.coordinator.workers.grpc_client import (
    GrpcDraftClient,
    GrpcTargetClient,
    GrpcWorkerClient,
)
from outrider.coordinator.workers.protocol import WorkerInfo
from outrider.drafters import DRAFTERS
from outrider.drafters.lookup import Lookup
from outrider.drafters.suffix import SuffixDecoding
from outrider.errors import Unavailable
from outrider.logging import get_logger
from outrider.metrics import MetricsEndpoint, RpcMetrics, serving_metrics
from outrider.rpc import RunningServer, run_service, serve_until_signalled, start_server
from outrider.startup import StartupError, auth_tokens, check_coordinator, first_line
from outrider.v1 import coordinator_pb2, coordinator_pb2_grpc

log = get_logger(__name__)
SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


async def serve(config: CoordinatorConfig, metrics: MetricsEndpoint | None = None) -> None:
    tokens = auth_tokens(config.auth_tokens_file) if config.auth_tokens_file else frozenset()
    tokenizer, generation_config = await load_tokenizer(config)
    worker_credentials = config.worker_tls.credentials() if config.worker_tls else None
    by_prefix = config.routing == "prefix"
    target = GrpcTargetClient(
        config.target, credentials=worker_credentials, prefix_routing=by_prefix
    )
    workers = (
        GrpcDraftClient(config.draft, credentials=worker_credentials, prefix_routing=by_prefix)
        if config.draft
        else None
    )
    lookup = lookup_of(config)
    draft = workers or lookup
    defaults = SpeculationDefaults(
        default_num_speculative_tokens=config.default_num_speculative_tokens if draft else 0,
        max_num_speculative_tokens=config.max_num_speculative_tokens,
        default_max_new_tokens=config.default_max_new_tokens,
        default_adaptive=config.adaptive and draft is not None,
        default_pipeline=config.pipeline and draft is not None,
    )
    try:
        # The coordinator serves once its target has described itself
        # (with k8s:// addresses: once a discovered endpoint is ready).
        target_info, draft_info = await connect(config, target, workers, lookup)
        service = CoordinatorService(
            Models(
                tokenizer,
                model_specs.eos_token_ids(tokenizer, generation_config),
                target_info,
                draft_info,
            ),
            target,
            draft,
            defaults,
            lookup=lookup if workers else None,
            draft_info=draft_info,
            recovery=config.recovery,
            limits=config.structured_output,
            metrics=CoordinatorMetrics(
                metrics.registry,
                model_name=target_info.model,
                max_num_speculative_tokens=defaults.max_num_speculative_tokens if draft else 0,
            )
            if metrics
            else None,
        )
        if metrics and isinstance(lookup, SuffixDecoding):
            SuffixCacheMetrics(metrics.registry, lookup.cache)
        await run(config, service, tokens, metrics)
    finally:
        await target.close()
        if workers:
            await workers.close()


def lookup_of(config: CoordinatorConfig) -> Lookup | None:
    """The drafter in this process whose setting is on, if any
    (:data:`outrider.drafters.DRAFTERS`)."""
    for kind in DRAFTERS.values():
        if kind.runs_in == "coordinator" and getattr(config, kind.setting):
            return kind.load(config)
    return None


async def load_tokenizer(config: CoordinatorConfig) -> tuple[Any, dict[str, Any]]:
    """The target's tokenizer and generation config (``--tokenizer``)."""
    try:
        tokenizer = await asyncio.to_thread(model_specs.load_tokenizer, config.tokenizer)
    except (OSError, ValueError) as exc:
        raise StartupError(
            "--tokenizer",
            config.tokenizer or model_specs.DEFAULT_MODEL,
            f"does not load: {first_line(exc)}",
        ) from None
    generation_config = await asyncio.to_thread(model_specs.generation_config, config.tokenizer)
    return tokenizer, generation_config


async def connect(
    config: CoordinatorConfig,
    target: GrpcTargetClient,
    workers: GrpcDraftClient | None,
    lookup: Lookup | None,
) -> tuple[WorkerInfo, WorkerInfo | None]:
    """Starts the worker clients and waits for each pool to say what it
    serves; a draft must pair with the target."""
    await target.start()
    if workers:
        await workers.start()
    target_info = await workers_info(target, "--target", config.target, config.worker_wait_s)
    draft_info = WorkerInfo.of_lookup(lookup.name) if lookup else None
    if workers:
        draft_info = await workers_info(workers, "--draft", config.draft, config.worker_wait_s)
        check_pairing(target_info, draft_info, config.draft)
        if lookup:  # (each round drafts by whichever pays)
            draft_info = replace(draft_info, drafter=f"{lookup.name}+{draft_info.drafter}")
    log.info(
        "workers ready",
        target=target_info.model,
        target_device=target_info.device,
        target_dtype=target_info.dtype,
        draft=draft_info.model if draft_info else None,
        draft_device=draft_info.device if draft_info else None,
    )
    return target_info, draft_info


async def run(
    config: CoordinatorConfig,
    service: CoordinatorService,
    tokens: frozenset[str],
    metrics: MetricsEndpoint | None,
) -> None:
    """Serves the gRPC API (and the HTTP API, with ``--http-port``) until a signal."""
    running = await start_server(
        lambda server: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server),
        [SERVICE_NAME],
        host=config.service.host,
        port=config.service.port,
        credentials=tls.credentials() if (tls := config.service.tls) else None,
        tokens=tokens,
        metrics=RpcMetrics(metrics.registry) if metrics else None,
    )
    http = (
        await serve_http(config, config.http_port, service, running, tokens)
        if config.http_port is not None
        else None
    )
    try:
        await serve_until_signalled(
            running,
            ready_file=config.service.ready_file,
            grace_s=config.service.shutdown_grace_s,
        )
    finally:
        if http is not None:
            await http.stop()


async def workers_info(
    client: GrpcWorkerClient, flag: str, addresses: tuple[str, ...], wait_s: float
) -> WorkerInfo:
    """What the workers at ``addresses`` (given as ``flag``) serve, once one
    has answered, within ``wait_s`` (--worker-wait-s)."""
    try:
        return await client.info(wait_s)
    except Unavailable as exc:
        raise StartupError(
            flag,
            ",".join(addresses),
            f"{exc}; start the worker first, or check the address "
            "(--worker-wait-s says how long to wait)",
        ) from None


def check_pairing(target: WorkerInfo, draft: WorkerInfo, addresses: tuple[str, ...]) -> None:
    """A draft worker serves the target's vocabulary."""
    if (target.vocab_fingerprint and draft.vocab_fingerprint) and (
        target.vocab_fingerprint != draft.vocab_fingerprint
    ):
        differs = "a vocabulary that differs from the target's"
    elif target.vocab_size and draft.vocab_size and target.vocab_size != draft.vocab_size:
        differs = f"a vocabulary of {draft.vocab_size} tokens, the target {target.vocab_size}"
    else:
        return
    raise StartupError(
        "--draft",
        ",".join(addresses),
        f"the draft worker serves {draft.model!r}, {differs} ({target.model!r}): serve a draft "
        "model that shares the target's tokenizer, or draft by prompt lookup (--prompt-lookup, "
        "no --draft)",
    )


async def serve_http(
    config: CoordinatorConfig,
    port: int,
    service: CoordinatorService,
    running: RunningServer,
    tokens: frozenset[str],
) -> HttpServer:
    """Starts the OpenAI-compatible API beside the gRPC one: the same round
    loop, TLS and tokens, and the same drain on shutdown. Its bound port is
    written next to the ready file (``*.http-port``)."""
    http = await start_http_server(
        create_app(service, tokens=tokens, drain=running.drain),
        host=config.service.host,
        port=port,
        tls=config.service.tls,
    )
    log.info("serving the OpenAI-compatible API", port=http.port, path="/v1")
    if config.service.ready_file is not None:
        port_file = http_port_file(config.service.ready_file)
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(http.port))
        tmp.replace(port_file)
    return http


def main(config: CoordinatorConfig) -> None:
    check_coordinator(config)
    with serving_metrics(config.service) as metrics:
        run_service(serve(config, metrics))
