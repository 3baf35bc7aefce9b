"""Prometheus metrics scraped over HTTP from the three services after real
generations: the speculation counters add up to the per-request statistics,
the request metrics count every request by outcome, and the workers' session
and cache gauges follow the sessions (up while one runs, back to 0 after)."""

from __future__ import annotations

import asyncio
import urllib.request
from collections import defaultdict

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from outrider.client import AsyncClient
from outrider.config import WorkerLimits
from outrider.v1 import worker_pb2 as wpb
from outrider.v1 import worker_pb2_grpc
from tests.integration.harness import running_stack

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
NO_EOS = -1  # an id no model emits: runs go to max_new_tokens


class Scrape:
    """One scrape of a /metrics page: sample values by name and labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[sample.name].append((sample.labels, sample.value))

    def value(self, name: str, **labels: str) -> float:
        """The sum over the samples of ``name`` whose labels include ``labels``."""
        matches = [v for found, v in self.samples[name] if labels.items() <= found.items()]
        assert matches, f"no sample {name}{labels} in:\n{self.text}"
        return sum(matches)


async def scrape(stack, service: str) -> Scrape:
    url = f"http://127.0.0.1:{stack.metrics[service].port}/metrics"

    def get() -> str:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()

    return Scrape(await asyncio.to_thread(get))


async def test_speculation_counters_add_up_to_the_per_request_stats(tiny_target_dir):
    async with (
        running_stack(
            tiny_target_dir,
            drafter="early-exit",
            draft_layers=1,
            eos_token_ids={NO_EOS},
            metrics=True,
        ) as stack,
        AsyncClient(stack.address) as client,
    ):
        # Unary requests at several K (K = 0: rounds without drafts) and adaptive K.
        stats = []
        for k, max_new in [(4, 23), (2, 17), (0, 9), (8, 30)]:
            result = await client.generate(
                prompt=PROMPT, max_new_tokens=max_new, num_speculative_tokens=k
            )
            stats.append(result.stats)
        stats.append((await client.generate(prompt=PROMPT, max_new_tokens=20, adaptive=True)).stats)

        # A streamed one: while it runs, the workers hold its session and cache.
        chunks = 0
        async for chunk in client.stream(
            prompt=PROMPT, max_new_tokens=24, num_speculative_tokens=3
        ):
            if chunks == 0:
                target = await scrape(stack, "target")
                assert target.value("outrider_worker_sessions_active") == 1
                assert target.value("outrider_worker_cached_tokens") >= len(chunk.token_ids)
                assert 0 < target.value("outrider_kv_cache_usage_perc") < 1
                running = (await scrape(stack, "coordinator")).value(
                    "outrider_num_requests_running"
                )
                assert running == 1
            chunks += 1
            if chunk.stats is not None:
                stats.append(chunk.stats)

        # A bad request is refused, and counted under its status code.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate(prompt=PROMPT, num_speculative_tokens=17)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await stack.sessions_left() == (0, 0)

        coordinator = await scrape(stack, "coordinator")
        target = await scrape(stack, "target")
        draft = await scrape(stack, "draft")

    assert len(stats) == 6
    assert sum(s.num_drafts for s in stats) < sum(
        s.rounds for s in stats
    )  # target-only rounds are no drafts
    assert stats[2].num_drafts == stats[2].draft_tokens == 0

    # Speculation: vLLM's counters equal the sums of the per-request stats.
    assert coordinator.value("outrider_spec_decode_num_drafts_total") == sum(
        s.num_drafts for s in stats
    )
    assert coordinator.value("outrider_spec_decode_num_draft_tokens_total") == sum(
        s.draft_tokens for s in stats
    )
    assert coordinator.value("outrider_spec_decode_num_accepted_tokens_total") == sum(
        s.accepted_tokens for s in stats
    )
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.draft_tokens for s in stats)
    for position in range(16):
        expected = sum(
            s.accepted_per_position[position]
            for s in stats
            if position < len(s.accepted_per_position)
        )
        per_pos = coordinator.value(
            "outrider_spec_decode_num_accepted_tokens_per_pos_total", position=str(position)
        )
        assert per_pos == expected, position
    # Pipelining (none of these requests asked for it): the counters exist and add up.
    for counter, field in [("hits", "speculation_hits"), ("misses", "speculation_misses")]:
        total = coordinator.value(f"outrider_spec_decode_num_speculation_{counter}_total")
        assert total == sum(getattr(s, field) for s in stats) == 0

    # Requests: six finished at their length, one refused.
    assert coordinator.value("outrider_request_success_total", finished_reason="length") == 6
    assert coordinator.value("outrider_request_success_total", finished_reason="stop") == 0
    assert (
        coordinator.value("outrider_generation_tokens_total")
        == sum(s.generated_tokens for s in stats)
        == 123
    )
    assert coordinator.value("outrider_prompt_tokens_total") == sum(s.prompt_tokens for s in stats)
    assert coordinator.value("outrider_num_requests_running") == 0
    assert coordinator.value("outrider_time_to_first_token_seconds_count") == 6
    assert coordinator.value("outrider_e2e_request_latency_seconds_count") == 6
    # One inter-token latency per streamed chunk after the first: one per round.
    assert coordinator.value("outrider_inter_token_latency_seconds_count") == sum(
        s.rounds - 1 for s in stats
    )
    assert coordinator.value("outrider_round_overhead_seconds_count") == sum(
        s.rounds for s in stats
    )
    handled = "outrider_grpc_server_handled_total"
    assert coordinator.value(handled, grpc_method="Complete", grpc_code="OK") == 5
    assert coordinator.value(handled, grpc_method="Generate", grpc_code="OK") == 1
    assert coordinator.value(handled, grpc_method="Complete", grpc_code="INVALID_ARGUMENT") == 1
    assert (
        coordinator.value("outrider_grpc_server_handling_seconds_count", grpc_method="Complete")
        == 6
    )

    # Workers: one target session per request, one draft session per request
    # that drafts (opened at its first drafting round, on the history so far);
    # every one closed by its coordinator; nothing left cached.
    # Six requests on one prompt: the prefix cache holds its full blocks
    # after the first, and prefill tokens are those it did not hold.
    drafting = sum(1 for s in stats if s.num_drafts > 0)
    prompt_tokens = stats[0].prompt_tokens
    cached = sum(s.cached_prompt_tokens for s in stats)
    assert cached == 5 * ((prompt_tokens - 1) // 16 * 16) > 0
    assert target.value("outrider_prefix_cache_queries_total") == 6 * prompt_tokens
    assert target.value("outrider_prefix_cache_hits_total") == cached
    assert target.value("outrider_worker_prefill_tokens_total") == 6 * prompt_tokens - cached
    draft_opened = draft.value("outrider_prefix_cache_queries_total")
    assert draft_opened >= drafting * prompt_tokens
    assert draft.value("outrider_worker_prefill_tokens_total") == draft_opened - draft.value(
        "outrider_prefix_cache_hits_total"
    )
    for worker, opened, rounds, step in (
        # (the first round of each request is its open: the prefill draws it)
        (target, 6, sum(s.rounds - 1 for s in stats), "verify"),
        (draft, drafting, sum(s.num_drafts for s in stats), "propose"),
    ):
        assert worker.value("outrider_worker_sessions_opened_total") == opened
        assert worker.value("outrider_worker_sessions_closed_total", reason="done") == opened
        assert worker.value("outrider_worker_sessions_closed_total") == opened
        assert worker.value("outrider_worker_sessions_active") == 0
        assert worker.value("outrider_worker_cached_tokens") == 0
        assert worker.value("outrider_kv_cache_usage_perc") == 0
        assert worker.value("outrider_worker_step_seconds_count", step="prefill") == opened
        assert worker.value("outrider_worker_step_seconds_count", step=step) == rounds
        assert (
            worker.value(
                "outrider_grpc_server_handled_total", grpc_method="Session", grpc_code="OK"
            )
            == opened
        )


async def test_a_full_worker_counts_the_refused_session(tiny_target_dir):
    async with (
        running_stack(
            tiny_target_dir,
            drafter=None,
            eos_token_ids={NO_EOS},
            limits=WorkerLimits(max_sessions=1),
            metrics=True,
        ) as stack,
        AsyncClient(stack.address) as client,
    ):
        stream = client.stream(prompt=PROMPT, max_new_tokens=8)
        await anext(stream)  # the only session slot is taken
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate(prompt=PROMPT, max_new_tokens=8)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        async for _ in stream:
            pass
        assert await stack.sessions_left() == (0, 0)
        coordinator = await scrape(stack, "coordinator")
        target = await scrape(stack, "target")

    assert target.value("outrider_worker_sessions_rejected_total", reason="RESOURCE_EXHAUSTED") == 1
    assert target.value("outrider_worker_sessions_opened_total") == 1
    assert target.value("outrider_worker_sessions_active") == 0
    handled = "outrider_grpc_server_handled_total"
    assert target.value(handled, grpc_method="Session", grpc_code="RESOURCE_EXHAUSTED") == 1
    assert coordinator.value(handled, grpc_method="Complete", grpc_code="RESOURCE_EXHAUSTED") == 1
    assert coordinator.value(handled, grpc_method="Generate", grpc_code="OK") == 1
    assert coordinator.value("outrider_request_success_total", finished_reason="length") == 1
    # The draft-less coordinator still exports the speculation counters, at 0.
    assert coordinator.value("outrider_spec_decode_num_drafts_total") == 0


async def test_a_worker_counts_a_session_done_only_when_its_coordinator_closed_it(tiny_target_dir):
    """A close ends the session OK, counted done; a stream that ends without
    one (a half-close, a cancel) was cut: CANCELLED, counted cancelled."""
    async with running_stack(tiny_target_dir, drafter=None, metrics=True) as stack:
        async with grpc.aio.insecure_channel(stack.target_servers[0].address) as channel:
            stub = worker_pb2_grpc.TargetWorkerStub(channel)
            opening = wpb.VerifyRequest(open=wpb.SessionOpen(token_ids=[5, 6, 7]))
            codes = []
            for end in ("close", "half-close", "cancel"):
                call = stub.Session()
                await call.write(opening)
                assert (await call.read()).WhichOneof("kind") == "opened"
                if end == "close":
                    await call.write(wpb.VerifyRequest(close=wpb.SessionClose()))
                if end == "cancel":
                    call.cancel()
                else:
                    await call.done_writing()
                codes.append(await call.code())
        assert await stack.sessions_left() == (0, 0)
        target = await scrape(stack, "target")

    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.CANCELLED]
    closed = "outrider_worker_sessions_closed_total"
    assert target.value(closed, reason="done") == 1
    assert target.value(closed, reason="cancelled") == 2
    handled = "outrider_grpc_server_handled_total"
    assert target.value(handled, grpc_method="Session", grpc_code="OK") == 1
    assert target.value(handled, grpc_method="Session", grpc_code="CANCELLED") == 2
