"""Prometheus metrics of the coordinator (served at ``/metrics`` on
``--metrics-port``, beside the gRPC metrics of :mod:`outrider.metrics`).

Names are vLLM's v1 names with ``outrider_`` in place of ``vllm:``, with the
same meaning, so a vLLM dashboard or alert carries over by renaming the
prefix.

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
* ``outrider_spec_decode_num_speculation_hits_total`` — pipelined rounds
  whose drafts were drafted while the previous round was verified (an
  Outrider name: vLLM does not pipeline);
* ``outrider_spec_decode_num_speculation_misses_total`` — pipelined rounds
  whose speculation was discarded because the verdict differed from what it
  assumed (those rounds drafted afresh). Hit rate = hits / (hits + misses);
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
  workers' compute and the waits behind other sessions' steps (RPC +
  coordinator).

Suffix decoding (``--suffix-decoding``), read at scrape time:
``outrider_suffix_cache_tokens`` (earlier outputs held),
``outrider_suffix_cache_lookups_total`` (drafts looked up) and
``outrider_suffix_cache_hits_total`` (of those, drafted from the earlier
outputs rather than the session's own history).

The hot path stays cheap: a request's aggregates are recorded once, when it
finishes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from outrider.coordinator.request_stats import Stats
from outrider.coordinator.round_loop import Delta
from outrider.metrics import PREFIX

# vLLM's buckets for the same histograms.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Round overhead is sub-millisecond on loopback.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class CoordinatorMetrics:
    """Request and speculation metrics of the coordinator (vLLM's names)."""

    def __init__(
        self, registry: CollectorRegistry, *, model_name: str, max_num_speculative_tokens: int
    ) -> None:
        self.registry = registry
        self.model_name = model_name
        self._add_request_metrics()
        self._add_spec_decode_metrics(max_num_speculative_tokens)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, ["model_name", *labels], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(
            PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry
        ).labels(self.model_name)

    def _add_request_metrics(self) -> None:
        self.running = Gauge(
            PREFIX + "num_requests_running",
            "Requests in the round loop.",
            ["model_name"],
            registry=self.registry,
        ).labels(self.model_name)
        self.success = self._counter(
            "request_success", "Requests finished, by finish reason.", ("finished_reason",)
        )
        self.success_by_reason = {
            r: self.success.labels(self.model_name, r) for r in ("stop", "length")
        }
        self.prompt_tokens = self._counter(
            "prompt_tokens", "Prompt tokens of finished requests."
        ).labels(self.model_name)
        self.generation_tokens = self._counter(
            "generation_tokens", "Tokens generated by finished requests."
        ).labels(self.model_name)
        self.ttft = self._histogram(
            "time_to_first_token_seconds",
            "Time from receiving a request to having its first tokens to stream.",
            TTFT_BUCKETS,
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds",
            "Time between consecutive streamed chunks of a request (one chunk per round).",
            ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds",
            "Time from receiving a request to its last tokens.",
            E2E_BUCKETS,
        )
        self.round_overhead = self._histogram(
            "round_overhead_seconds",
            "Per round: wall time outside the workers' compute (RPC + coordinator).",
            OVERHEAD_BUCKETS,
        )

    def _add_spec_decode_metrics(self, max_num_speculative_tokens: int) -> None:
        def counter(name: str, doc: str) -> Counter:
            return self._counter("spec_decode_" + name, doc).labels(self.model_name)

        self.num_drafts = counter("num_drafts", "Rounds that verified at least one draft token.")
        self.num_draft_tokens = counter("num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("num_accepted_tokens", "Draft tokens accepted.")
        self.num_speculation_hits = counter(
            "num_speculation_hits",
            "Pipelined rounds whose drafts were drafted during the previous verify.",
        )
        self.num_speculation_misses = counter(
            "num_speculation_misses",
            "Pipelined rounds whose speculation was discarded"
            " (the verdict differed from its assumption).",
        )
        self._per_pos = self._counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position (0-based) was accepted.",
            ("position",),
        )
        self.accepted_per_pos = [
            self._per_pos.labels(self.model_name, str(p)) for p in range(max_num_speculative_tokens)
        ]

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
                    assert delta.finish_reason is not None  # the last delta carries both
                    self._finished(delta.stats, delta.finish_reason, received, chunk_times)
                yield delta
        finally:
            self.running.dec()

    def _finished(
        self, stats: Stats, finish_reason: str, received: float, chunk_times: list[float]
    ) -> None:
        self.success_by_reason[finish_reason].inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        self.ttft.observe(chunk_times[0] - received)
        for before, after in itertools.pairwise(chunk_times):
            self.itl.observe(after - before)
        self.e2e.observe(chunk_times[-1] - received)
        for overhead in stats.overheads_s:
            self.round_overhead.observe(overhead)
        self.num_drafts.inc(stats.num_drafts)
        self.num_draft_tokens.inc(stats.draft_tokens)
        self.num_accepted_tokens.inc(stats.accepted_tokens)
        self.num_speculation_hits.inc(stats.speculation_hits)
        self.num_speculation_misses.inc(stats.speculation_misses)
        for position, accepted in enumerate(stats.accepted_per_position):
            if position >= len(self.accepted_per_pos):
                self.accepted_per_pos.append(self._per_pos.labels(self.model_name, str(position)))
            self.accepted_per_pos[position].inc(accepted)


class SuffixCacheMetrics:
    """The shared outputs of suffix decoding (``outrider.drafters.suffix.SuffixCache``),
    read at scrape time."""

    def __init__(self, registry: CollectorRegistry, cache) -> None:
        self.cache = cache
        registry.register(self)

    def collect(self):
        yield GaugeMetricFamily(
            PREFIX + "suffix_cache_tokens",
            "Tokens of earlier outputs suffix decoding drafts from.",
            value=self.cache.tokens,
        )
        yield CounterMetricFamily(
            PREFIX + "suffix_cache_lookups",
            "Suffix decoding drafts looked up.",
            value=self.cache.lookups,
        )
        yield CounterMetricFamily(
            PREFIX + "suffix_cache_hits",
            "Suffix decoding drafts taken from earlier outputs (not the session's own history).",
            value=self.cache.hits,
        )
