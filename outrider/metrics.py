"""Prometheus metrics: every service serves its own at ``/metrics`` over HTTP
on ``--metrics-port`` (unset: no metrics, and nothing is recorded).

Names are vLLM's v1 names with ``outrider_`` in place of ``vllm:``, with the
same meaning, so a vLLM dashboard or alert carries over by renaming the
prefix. Prometheus reserves colons for recording rules (its naming guide:
"exporters should not use colons"), so the separator is an underscore.

Coordinator (per request, recorded when it finishes unless said otherwise):

* ``outrider_spec_decode_num_drafts_total`` — rounds that verified at least
  one draft token (vLLM counts one *draft* per request per step that carried
  draft tokens; target-only rounds, K = 0 or a lost draft, are not drafts);
* ``outrider_spec_decode_num_draft_tokens_total`` — draft tokens verified;
* ``outrider_spec_decode_num_accepted_tokens_total`` — draft tokens accepted
  (the recovered or bonus token is not counted);
* ``outrider_spec_decode_num_accepted_tokens_per_pos_total{position}`` —
  drafts whose token at ``position`` (0-based) was accepted. Acceptance rate
  = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts.
* ``outrider_time_to_first_token_seconds`` — from receiving the request to
  having its first tokens to stream (tokenization, both prefills and the
  first round included);
* ``outrider_inter_token_latency_seconds`` — time between consecutive
  streamed chunks of a request. A chunk is one round (its accepted drafts
  plus the recovered or bonus token), as vLLM observes one latency per
  engine step whatever the number of tokens the step produced;
* ``outrider_e2e_request_latency_seconds``, ``outrider_request_success_total
  {finished_reason}``, ``outrider_prompt_tokens_total``,
  ``outrider_generation_tokens_total``;
* ``outrider_num_requests_running`` — requests in the round loop (live);
* ``outrider_round_overhead_seconds`` — per round, the wall time outside the
  workers' compute (RPC + coordinator).

Workers: ``outrider_worker_sessions_active`` and
``outrider_worker_cached_tokens`` (read from the session store at scrape
time), ``outrider_kv_cache_usage_perc`` (the fraction of the worker's KV
cache blocks in use, 0 to 1), sessions opened / rejected by status /
closed by how the stream ended, prefill tokens,
``outrider_worker_step_seconds{step}`` (prefill, propose or verify, engine
queue included), and per engine step ``outrider_iteration_tokens_total``
(vLLM's name), ``outrider_worker_step_rows`` (sessions batched) and
``outrider_worker_forward_seconds``.

Every service: ``outrider_grpc_server_handled_total{grpc_service,
grpc_method, grpc_code}`` and ``outrider_grpc_server_handling_seconds``
(go-grpc-prometheus's names; a refused request is counted under its status
code), and the process, platform and garbage-collector collectors.

The hot path stays cheap: the coordinator records a request's aggregates
once, when it finishes; a worker observes one histogram per round.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

from outrider.logging import get_logger

if TYPE_CHECKING:
    from threading import Thread

    from coordinator.loop import Delta
    from outrider.config import ServiceAddress
    from outrider.engine import StepStats
    from outrider.session import SessionStore

log = get_logger(__name__)

PREFIX = "outrider_"

# vLLM's buckets for the same histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# Round overhead is sub-millisecond on loopback; compute steps span 1 ms to seconds.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256)
RPC_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


# --- the HTTP endpoint --------------------------------------------------------------


@dataclass
class MetricsEndpoint:
    """A service's registry, served over HTTP at ``/metrics`` on ``port``."""

    registry: CollectorRegistry
    port: int
    _server: WSGIServer
    _thread: Thread

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def metrics_port_file(ready_file: Path) -> Path:
    """Where a service with ``--ready-file F`` writes its bound metrics port."""
    return ready_file.with_suffix(".metrics-port")


def start_metrics_endpoint(host: str, port: int) -> MetricsEndpoint:
    """A fresh registry with the process, platform and GC collectors, served
    on ``host:port`` (0: any free port) by a daemon thread."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    server, thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
    return MetricsEndpoint(registry, server.server_port, server, thread)


@contextmanager
def serving_metrics(address: ServiceAddress) -> Iterator[MetricsEndpoint | None]:
    """Serves a service's metrics while the block runs, when it has a
    metrics port; writes the bound port next to its ready file."""
    if address.metrics_port is None:
        yield None
        return
    endpoint = start_metrics_endpoint(address.host, address.metrics_port)
    log.info("serving metrics", port=endpoint.port, path="/metrics")
    port_file = metrics_port_file(address.ready_file) if address.ready_file else None
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(endpoint.port))
        tmp.replace(port_file)
    try:
        yield endpoint
    finally:
        endpoint.stop()


# --- every service: gRPC calls ------------------------------------------------------


class RpcMetrics:
    """Calls handled, by method and status code, and their duration."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_service", "grpc_method"]
        self.handled = Counter(
            PREFIX + "grpc_server_handled",
            "RPCs completed on the server, by status code (a refused request counts under its code).",
            [*labels, "grpc_code"],
            registry=registry,
        )
        self.seconds = Histogram(
            PREFIX + "grpc_server_handling_seconds",
            "Duration of RPCs on the server (of the whole stream for streaming RPCs).",
            labels,
            buckets=RPC_BUCKETS,
            registry=registry,
        )

        self._children: dict[tuple[str, grpc.StatusCode], tuple[Counter, Histogram]] = {}

    def observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        children = self._children.get((method, code))
        if children is None:  # once per method and code: label lookups are the slow part
            service, _, name = method.lstrip("/").rpartition("/")
            children = self._children[method, code] = (
                self.handled.labels(service, name, code.name),
                self.seconds.labels(service, name),
            )
        children[0].inc()
        children[1].observe(seconds)


# --- coordinator --------------------------------------------------------------------


class CoordinatorMetrics:
    """Request and speculation metrics of the coordinator (vLLM's names)."""

    def __init__(self, registry: CollectorRegistry, *, model_name: str, max_num_speculative_tokens: int) -> None:
        model = {"model_name": model_name}

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name", *labels], registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=registry).labels(**model)

        self.running = Gauge(
            PREFIX + "num_requests_running", "Requests in the round loop.", ["model_name"], registry=registry
        ).labels(**model)
        self.success = counter("request_success", "Requests finished, by finish reason.", ("finished_reason",))
        self.success_by_reason = {r: self.success.labels(model_name, r) for r in ("stop", "length")}
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(**model)
        self.generation_tokens = counter("generation_tokens", "Tokens generated by finished requests.").labels(**model)
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Time from receiving a request to having its first tokens to stream.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between consecutive streamed chunks of a request (one chunk per round).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from receiving a request to its last tokens.", E2E_BUCKETS
        )
        self.round_overhead = histogram(
            "round_overhead_seconds", "Per round: wall time outside the workers' compute (RPC + coordinator).",
            OVERHEAD_BUCKETS,
        )  # fmt: skip
        self.num_drafts = counter("spec_decode_num_drafts", "Rounds that verified at least one draft token.").labels(**model)
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.").labels(**model)
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(**model)
        self._per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position (0-based) was accepted.",
            ("position",),
        )
        self.model_name = model_name
        self.accepted_per_pos = [self._per_pos.labels(model_name, str(p)) for p in range(max_num_speculative_tokens)]

    async def track(self, deltas: AsyncIterator[Delta], received: float) -> AsyncIterator[Delta]:
        """Passes a request's deltas through, timing them; records the
        request when its last delta (the one with the stats) goes by.
        ``received``: ``time.perf_counter()`` when the request arrived."""
        chunk_times: list[float] = []
        self.running.inc()
        try:
            async for delta in deltas:
                chunk_times.append(time.perf_counter())
                if delta.stats is not None:
                    self._finished(delta, received, chunk_times)
                yield delta
        finally:
            self.running.dec()

    def _finished(self, delta: Delta, received: float, chunk_times: list[float]) -> None:
        stats = delta.stats
        self.success_by_reason[delta.finish_reason].inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        self.ttft.observe(chunk_times[0] - received)
        for before, after in zip(chunk_times, chunk_times[1:]):
            self.itl.observe(after - before)
        self.e2e.observe(chunk_times[-1] - received)
        for overhead in stats.overheads_s:
            self.round_overhead.observe(overhead)
        self.num_drafts.inc(stats.num_drafts)
        self.num_draft_tokens.inc(stats.draft_tokens)
        self.num_accepted_tokens.inc(stats.accepted_tokens)
        for position, accepted in enumerate(stats.accepted_per_position):
            if position >= len(self.accepted_per_pos):
                self.accepted_per_pos.append(self._per_pos.labels(self.model_name, str(position)))
            self.accepted_per_pos[position].inc(accepted)


# --- workers ------------------------------------------------------------------------


class WorkerMetrics:
    """Sessions, cache and step latencies of a draft or target worker."""

    ROUND_STEP = {"draft": "propose", "target": "verify"}

    def __init__(self, registry: CollectorRegistry, store: SessionStore, *, role: str) -> None:
        Gauge(
            PREFIX + "worker_sessions_active", "Sessions open on this worker.", registry=registry
        ).set_function(lambda: len(store))
        Gauge(
            PREFIX + "worker_cached_tokens", "Tokens held in the KV caches of this worker's sessions.", registry=registry
        ).set_function(lambda: store.cached_tokens)
        Gauge(
            PREFIX + "kv_cache_usage_perc",
            "Fraction of the worker's KV cache blocks in use, 0 to 1 "
            "(0 for a model-free drafter, which caches nothing).",
            registry=registry,
        ).set_function(lambda: store.usage)
        self.opened = Counter(PREFIX + "worker_sessions_opened", "Sessions opened (prefilled).", registry=registry)
        self.rejected = Counter(
            PREFIX + "worker_sessions_rejected",
            "Session opens refused, by gRPC status (RESOURCE_EXHAUSTED: the worker is full).",
            ["reason"],
            registry=registry,
        )
        self.closed = Counter(
            PREFIX + "worker_sessions_closed",
            "Sessions closed, by how the stream ended: done (the coordinator ended it), cancelled, or error.",
            ["reason"],
            registry=registry,
        )
        self.prefill_tokens = Counter(
            PREFIX + "worker_prefill_tokens", "Tokens of the histories sessions were opened on.", registry=registry
        )
        steps = Histogram(
            PREFIX + "worker_step_seconds",
            "Time to answer a session message, the wait for the engine thread included.",
            ["step"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.prefill_seconds = steps.labels("prefill")
        self.round_seconds = steps.labels(self.ROUND_STEP[role])
        self.iteration_tokens = Histogram(
            PREFIX + "iteration_tokens_total",
            "Tokens per engine step (one forward pass over every session's work).",
            buckets=ITERATION_TOKEN_BUCKETS,
            registry=registry,
        )
        self.iteration_rows = Histogram(
            PREFIX + "worker_step_rows",
            "Sessions per engine step (the batch size of one forward pass).",
            buckets=ROW_BUCKETS,
            registry=registry,
        )
        self.forward_seconds = Histogram(
            PREFIX + "worker_forward_seconds",
            "Time of one engine step's forward pass.",
            buckets=STEP_BUCKETS,
            registry=registry,
        )

    def step(self, stats: StepStats) -> None:
        """One engine step ran (called on the engine thread)."""
        self.iteration_tokens.observe(stats.tokens)
        self.iteration_rows.observe(stats.rows)
        self.forward_seconds.observe(stats.seconds)

    def session_opened(self, tokens: int, seconds: float) -> None:
        self.opened.inc()
        self.prefill_tokens.inc(tokens)
        self.prefill_seconds.observe(seconds)
