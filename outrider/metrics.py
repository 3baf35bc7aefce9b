"""Prometheus metrics: every service serves its own at ``/metrics`` over HTTP
on ``--metrics-port`` (unset: no metrics, and nothing is recorded).

Names are vLLM's v1 names with ``outrider_`` in place of ``vllm:``, with the
same meaning, so a vLLM dashboard or alert carries over by renaming the
prefix. Prometheus reserves colons for recording rules (its naming guide:
"exporters should not use colons"), so the separator is an underscore.

The coordinator's request and speculation metrics live beside its round
loop, in :mod:`outrider.coordinator.metrics`, with the same registry and names.

Workers: ``outrider_worker_sessions_active`` and
``outrider_worker_cached_tokens`` (read from the session store at scrape
time), ``outrider_kv_cache_usage_perc`` (the fraction of the worker's KV
cache blocks in use, 0 to 1), sessions opened / rejected by status /
closed by how the stream ended, prefill tokens (those not found in the
prefix cache), ``outrider_prefix_cache_queries_total`` and
``outrider_prefix_cache_hits_total`` (in tokens, as vLLM's),
``outrider_worker_step_seconds{step}`` (prefill, propose or verify, engine
queue included), and per engine step ``outrider_iteration_tokens_total``
(vLLM's name), ``outrider_worker_step_rows`` (sessions batched) and
``outrider_worker_forward_seconds``.

Every service: ``outrider_grpc_server_handled_total{grpc_service,
grpc_method, grpc_code}`` and ``outrider_grpc_server_handling_seconds``
(go-grpc-prometheus's names; a refused request is counted under its status
code), and the process, platform and garbage-collector collectors.

The hot path stays cheap: a worker observes one histogram per round and
three per engine step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

from outrider.logging import get_logger
from outrider.startup import StartupError

if TYPE_CHECKING:
    from threading import Thread

    from outrider.config import ServiceConfig
    from outrider.engine import StepStats
    from outrider.session import SessionStore

log = get_logger(__name__)

PREFIX = "outrider_"

# Compute steps span 1 ms to seconds.
STEP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
"""Those of the CUDA graphs (``outrider.engine.cuda_graphs``, which a test holds
them equal to), so a step's bucket shows which graph it replayed; repeated
here so that the coordinator's metrics import no torch."""
RPC_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


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
    try:
        server, thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
    except OSError as exc:
        raise StartupError("--metrics-port", port, f"cannot listen there: {exc.strerror}") from None
    return MetricsEndpoint(registry, server.server_port, server, thread)


@contextmanager
def serving_metrics(address: ServiceConfig) -> Iterator[MetricsEndpoint | None]:
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
            "RPCs completed on the server, by status code "
            "(a refused request counts under its code).",
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


# --- workers ------------------------------------------------------------------------


class WorkerMetrics:
    """Sessions, cache and step latencies of a draft or target worker."""

    ROUND_STEP = {"draft": "propose", "target": "verify"}

    def __init__(self, registry: CollectorRegistry, store: SessionStore, *, role: str) -> None:
        _add_store_gauges(registry, store)
        self.opened = Counter(
            PREFIX + "worker_sessions_opened", "Sessions opened (prefilled).", registry=registry
        )
        self.rejected = Counter(
            PREFIX + "worker_sessions_rejected",
            "Session opens refused, by gRPC status (RESOURCE_EXHAUSTED: the worker is full).",
            ["reason"],
            registry=registry,
        )
        self.closed = Counter(
            PREFIX + "worker_sessions_closed",
            "Sessions closed, by what ended them: done (closed by the coordinator, its generation "
            "finished), cancelled (cut: cancelled, or the coordinator gone), or an error status.",
            ["reason"],
            registry=registry,
        )
        self.prefill_tokens = Counter(
            PREFIX + "worker_prefill_tokens",
            "Tokens of the histories sessions were opened on, prefilled (not found in the "
            "prefix cache).",
            registry=registry,
        )
        self.caching = store.pool.caching
        self.prefix_cache_queries, self.prefix_cache_hits = _prefix_cache_counters(registry)
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

    def session_opened(self, tokens: int, cached: int, seconds: float) -> None:
        """A session opened on ``tokens`` tokens, ``cached`` of them from the prefix cache."""
        self.opened.inc()
        self.prefill_tokens.inc(tokens - cached)
        self.prefill_seconds.observe(seconds)
        if self.caching:
            self.prefix_cache_queries.inc(tokens)
            self.prefix_cache_hits.inc(cached)


def _prefix_cache_counters(registry: CollectorRegistry) -> tuple[Counter, Counter]:
    """vLLM's prefix cache queries and hits, in tokens."""
    queries = Counter(
        PREFIX + "prefix_cache_queries",
        "Tokens of the histories sessions were opened on, looked up in the prefix cache "
        "(counted where the worker caches prefixes).",
        registry=registry,
    )
    hits = Counter(
        PREFIX + "prefix_cache_hits",
        "Of those, tokens found in the prefix cache (not prefilled).",
        registry=registry,
    )
    return queries, hits


def _add_store_gauges(registry: CollectorRegistry, store: SessionStore) -> None:
    """The worker's sessions, cached tokens and KV cache usage, read from
    ``store`` at scrape time."""
    Gauge(
        PREFIX + "worker_sessions_active", "Sessions open on this worker.", registry=registry
    ).set_function(lambda: len(store))
    Gauge(
        PREFIX + "worker_cached_tokens",
        "Tokens held in the KV caches of this worker's sessions.",
        registry=registry,
    ).set_function(lambda: store.cached_tokens)
    Gauge(
        PREFIX + "kv_cache_usage_perc",
        "Fraction of the worker's KV cache blocks in use, 0 to 1.",
        registry=registry,
    ).set_function(lambda: store.usage)
