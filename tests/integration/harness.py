"""The three services as real grpc.aio servers on 127.0.0.1 port 0, in the
test's event loop, on tiny float64 models."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from outrider.config import (
    DraftWorkerConfig,
    EngineConfig,
    Recovery,
    ServiceConfig,
    StructuredOutputLimits,
    TargetWorkerConfig,
    WorkerLimits,
)
from outrider.coordinator.metrics import CoordinatorMetrics
from outrider.coordinator.openai import HttpServer, create_app, start_http_server
from outrider.coordinator.requests import SpeculationDefaults
from outrider.coordinator.served_models import Models
from outrider.coordinator.service import CoordinatorService
from outrider.coordinator.workers.grpc_client import GrpcDraftClient, GrpcTargetClient
from outrider.coordinator.workers.protocol import WorkerInfo
from outrider.draft_worker import main as draft_main
from outrider.draft_worker.sessions import DraftSessions
from outrider.drafters.lookup import PromptLookup
from outrider.drafters.suffix import SuffixDecoding
from outrider.metrics import MetricsEndpoint, RpcMetrics, WorkerMetrics, start_metrics_endpoint
from outrider.rpc import RunningServer, start_server
from outrider.security import ClientTls, ServerTls
from outrider.target_worker import main as target_main
from outrider.target_worker.sessions import TargetSessions
from outrider.v1 import coordinator_pb2_grpc
from outrider.worker import AnyEngine, open_worker

SERVICE = ServiceConfig()


class PacedRunner:
    """A model runner whose every forward pass takes ``step_s`` seconds (the
    rest of it asleep, the GIL released): workers that behave like models of
    a chosen cost on machines of their own, on a machine of two cores."""

    def __init__(self, runner, step_s: float) -> None:
        self.runner = runner
        self.step_s = step_s

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, rows):
        started = time.perf_counter()
        outputs = self.runner.execute(rows)
        time.sleep(max(0.0, self.step_s - (time.perf_counter() - started)))
        return outputs


@dataclass
class Stack:
    address: str
    target: TargetSessions
    draft: DraftSessions | None
    targets: list[TargetSessions]
    target_servers: list[RunningServer]
    draft_server: RunningServer | None
    draft_engine: AnyEngine | None = None
    metrics: dict[str, MetricsEndpoint] = field(default_factory=dict)
    """With ``running_stack(metrics=True)``: each service's /metrics endpoint
    (``target``, ``target-1``, ..., ``draft``, ``coordinator``)."""
    coordinator: CoordinatorService | None = None
    http_url: str | None = None
    """With ``running_stack(http=True)``: the coordinator's OpenAI-compatible
    API, ``http://127.0.0.1:PORT`` (``https://`` with ``coordinator_tls``)."""

    async def sessions_left(self, timeout_s: float = 5.0) -> tuple[int, int]:
        """Open sessions on (all targets, draft) once pending closes have run."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            counts = (
                sum(len(t.store) for t in self.targets),
                len(self.draft.store) if self.draft else 0,
            )
            if counts == (0, 0) or asyncio.get_running_loop().time() > deadline:
                return counts
            await asyncio.sleep(0.02)


@asynccontextmanager
async def running_stack(
    target_dir: Path,
    *,
    drafter: str | None = "model",
    draft_dir: Path | None = None,
    draft_layers: int | None = None,
    head_dir: Path | None = None,
    k: int = 4,
    eos_token_ids: Collection[int] | None = None,
    limits: WorkerLimits = WorkerLimits(),
    target_replicas: int = 1,
    recovery: Recovery = Recovery(),
    worker_tls: tuple[ServerTls, ClientTls] | None = None,
    coordinator_tls: ServerTls | None = None,
    tokens: frozenset[str] = frozenset(),
    metrics: bool = False,
    publish_targets: Callable[[list[str]], Awaitable[Sequence[str]]] | None = None,
    kube_api=None,
    engine: EngineConfig = EngineConfig(dtype="float64", threads=1),
    step_s: dict[str, float] | None = None,
    http: bool = False,
    structured_output: StructuredOutputLimits = StructuredOutputLimits(),
) -> AsyncIterator[Stack]:
    """The workers are built and run as ``outrider serve`` builds and runs
    them (``drafter``: a draft worker's, a lookup's — "prompt-lookup",
    "suffix" — or suffix decoding beside a draft worker's, "suffix+model";
    ``engine`` says how: by default float64 on the CPU, each model
    worker batching on its own engine thread). ``step_s`` paces the
    workers' forward passes (``{"target": s, "draft": s}``, see
    :class:`PacedRunner`). ``http``: the coordinator also serves its
    OpenAI-compatible API (``Stack.http_url``). ``publish_targets`` gets the
    target workers' addresses and returns the ones the coordinator is given
    (e.g. k8s:// ones after publishing EndpointSlices to the API server that
    ``kube_api`` reaches)."""
    worker_credentials = worker_tls[0].credentials() if worker_tls else None
    worker_client_credentials = worker_tls[1].credentials() if worker_tls else None
    servers: list[RunningServer] = []
    engines: list[AnyEngine] = []
    clients = []
    endpoints: dict[str, MetricsEndpoint] = {}
    http_server: HttpServer | None = None
    http_url = None

    def registry(name: str):
        """A service's metrics registry, served on a free port; None without ``metrics``."""
        if not metrics:
            return None
        endpoints[name] = start_metrics_endpoint("127.0.0.1", 0)
        return endpoints[name].registry

    try:
        target_config = TargetWorkerConfig(
            service=SERVICE, model=str(target_dir), engine=engine, limits=limits
        )
        target_workers, target_servers = [], []
        for replica in range(target_replicas):
            target_registry = registry(f"target-{replica}" if replica else "target")
            steps = []  # the worker's metrics exist once its store does
            worker, target_engine, warm_up = await open_worker(
                target_main.ROLE,
                target_config,
                on_step=lambda s, steps=steps: steps and steps[0].step(s),
            )
            target_metrics = (
                WorkerMetrics(target_registry, worker.store, role="target") if metrics else None
            )
            steps.extend([target_metrics] if target_metrics else [])
            target_workers.append(worker)
            engines.append(target_engine)
            if step_s and "target" in step_s:
                target_engine.runner = PacedRunner(target_engine.runner, step_s["target"])
            await warm_up()
            target_servers.append(
                await start_server(
                    lambda s, w=worker, e=target_engine, m=target_metrics: (
                        target_main.ROLE.add_servicer(
                            s, w, e, idle_timeout_s=limits.session_idle_timeout_s, metrics=m
                        )
                    ),
                    [target_main.SERVICE_NAME],
                    credentials=worker_credentials,
                    metrics=RpcMetrics(target_registry) if metrics else None,
                )
            )
        servers.extend(target_servers)
        target_addresses = [server.address for server in target_servers]
        target = GrpcTargetClient(
            await publish_targets(target_addresses) if publish_targets else target_addresses,
            credentials=worker_client_credentials,
            kube_api=kube_api,
        )
        clients.append(target)
        await target.start()

        draft_worker, draft_engine, draft, draft_info = None, None, None, None
        lookup = None  # beside the draft worker: "suffix+DRAFTER"
        if drafter is not None and drafter.startswith("suffix+"):
            lookup, drafter = SuffixDecoding(), drafter.removeprefix("suffix+")
        if drafter in ("prompt-lookup", "suffix"):  # (in the coordinator: no draft worker)
            draft = PromptLookup() if drafter == "prompt-lookup" else SuffixDecoding()
            draft_info = WorkerInfo.of_lookup(draft.name)
        elif drafter is not None:
            draft_config = DraftWorkerConfig(
                service=SERVICE,
                drafter=drafter,
                model=str(draft_dir or target_dir),
                engine=engine,
                draft_layers=draft_layers,
                head=str(head_dir) if head_dir else None,
                limits=limits,
            )
            draft_registry = registry("draft")
            steps = []
            draft_worker, draft_engine, warm_up = await open_worker(
                draft_main.ROLE, draft_config, on_step=lambda s: steps and steps[0].step(s)
            )
            draft_metrics = (
                WorkerMetrics(draft_registry, draft_worker.store, role="draft") if metrics else None
            )
            steps.extend([draft_metrics] if draft_metrics else [])
            engines.append(draft_engine)
            if step_s and "draft" in step_s:
                draft_engine.runner = PacedRunner(draft_engine.runner, step_s["draft"])
            await warm_up()
            servers.append(
                await start_server(
                    lambda s: draft_main.ROLE.add_servicer(
                        s,
                        draft_worker,
                        draft_engine,
                        idle_timeout_s=limits.session_idle_timeout_s,
                        metrics=draft_metrics,
                    ),
                    [draft_main.SERVICE_NAME],
                    credentials=worker_credentials,
                    metrics=RpcMetrics(draft_registry) if metrics else None,
                )
            )
            draft = GrpcDraftClient([servers[-1].address], credentials=worker_client_credentials)
            clients.append(draft)
            draft_info = await draft.info(10)

        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        target_info = await target.info(10)
        eos = (
            frozenset(eos_token_ids)
            if eos_token_ids is not None
            else frozenset({tokenizer.eos_token_id})
        )
        coordinator_registry = registry("coordinator")
        service = CoordinatorService(
            Models(tokenizer, eos, target_info),
            target,
            draft,
            SpeculationDefaults(
                default_num_speculative_tokens=k,
                max_num_speculative_tokens=16,
                default_max_new_tokens=64,
            ),
            recovery=recovery,
            draft_info=draft_info,
            lookup=lookup,
            limits=structured_output,
            metrics=CoordinatorMetrics(
                coordinator_registry, model_name=target_info.model, max_num_speculative_tokens=16
            )
            if metrics
            else None,
        )
        servers.append(
            await start_server(
                lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, s),
                ["outrider.v1.Coordinator"],
                credentials=coordinator_tls.credentials() if coordinator_tls else None,
                tokens=tokens,
                metrics=RpcMetrics(coordinator_registry) if metrics else None,
            )
        )
        if http:
            http_server = await start_http_server(
                create_app(service, tokens=tokens, drain=servers[-1].drain),
                host="127.0.0.1",
                port=0,
                tls=coordinator_tls,
            )
            scheme = "https" if coordinator_tls else "http"
            http_url = f"{scheme}://127.0.0.1:{http_server.port}"
        for server in servers:
            await server.set_serving(True)
        yield Stack(
            servers[-1].address,
            target_workers[0],
            draft_worker,
            target_workers,
            target_servers,
            servers[target_replicas] if draft_worker is not None else None,
            draft_engine,
            endpoints,
            service,
            http_url,
        )
    finally:
        if http_server is not None:
            await http_server.stop()
        for server in reversed(servers):
            await server.stop(None)
        for client in clients:
            await client.close()
        for worker_engine in engines:
            worker_engine.shutdown()
            if (close := getattr(worker_engine.runner, "close", None)) is not None:
                close()  # a llama.cpp context, a tensor-parallel worker's ranks
        for endpoint in endpoints.values():
            endpoint.stop()


def reference_greedy(
    model_dir: Path, prompt_ids: list[int], max_new_tokens: int, eos: int | None
) -> list[int]:
    """Target-only greedy decoding with Hugging Face generate, float64."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


class BackgroundLoop:
    """An event loop on a thread of its own, for a stack that synchronous
    clients (hypothesis's tests) call."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="stack-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
