"""Each closed session is counted by what ended it, under 50 concurrent
streams of real processes: ``done`` when its generation finished, and
``cancelled`` when it was cut — its client cancelled the stream, or its
coordinator was SIGKILLed mid-stream. The RPC counter of the workers'
Session calls agrees (OK and CANCELLED)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from outrider.client import AsyncClient
from outrider.metrics import metrics_port_file
from tests.stress.cluster import Service, sessions_left, start_stack, worker_info
from tests.stress.conftest import MAX_NEW

pytestmark = pytest.mark.stress
FINISHED, CANCELLED, KILLED = 20, 15, 15
"""Streams that finish, that their client cancels after two chunks, and that
are in flight when the coordinator is killed: 50 at once."""


def scrape(service: Service) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The service's metric samples: (name, labels) -> value."""
    port = int(metrics_port_file(service.ready_file).read_text())
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def by_label(samples, name: str, label: str, **labels: str) -> dict[str, int]:
    """The values of ``name`` whose labels include ``labels``, by ``label``."""
    counts = {}
    for (sample, sample_labels), value in samples.items():
        found = dict(sample_labels)
        if sample == name and labels.items() <= found.items() and value:
            counts[found[label]] = int(value)
    return counts


async def test_closed_sessions_are_counted_by_what_ended_them_under_50_concurrent_streams(
    cluster, tiny_target_dir, tiny_draft_same_dir, prompt_ids
):
    metrics = ["--metrics-port", "0"]
    stack = await start_stack(
        cluster, tiny_target_dir, tiny_draft_same_dir, target_args=metrics, draft_args=metrics
    )
    killed_streaming = asyncio.Event()
    killed_chunks = [0] * KILLED

    async with AsyncClient(stack.coordinator.address, timeout=60) as client:

        async def finished() -> str:
            result = await client.generate(
                token_ids=prompt_ids, max_new_tokens=8, ignore_eos=True, num_speculative_tokens=4
            )
            return result.finish_reason

        async def cancelled() -> int:
            stream = client.stream(
                token_ids=prompt_ids,
                max_new_tokens=MAX_NEW,
                ignore_eos=True,
                num_speculative_tokens=4,
            )
            chunks = 0
            async with contextlib.aclosing(stream):  # closing it cancels the call
                async for _ in stream:
                    chunks += 1
                    if chunks == 2:
                        break
            return chunks

        async def killed(i: int) -> grpc.StatusCode | None:
            """A long stream (K = 1: 200 rounds) cut by the coordinator's death."""
            try:
                async for chunk in client.stream(
                    token_ids=prompt_ids,
                    max_new_tokens=MAX_NEW,
                    ignore_eos=True,
                    num_speculative_tokens=1,
                ):
                    assert chunk.finish_reason is None, "a stream outlived the coordinator's kill"
                    killed_chunks[i] += 1
                    if all(killed_chunks):
                        killed_streaming.set()
            except grpc.aio.AioRpcError as error:
                return error.code()
            return None

        long_streams = [asyncio.ensure_future(killed(i)) for i in range(KILLED)]
        short = await asyncio.gather(
            *(finished() for _ in range(FINISHED)), *(cancelled() for _ in range(CANCELLED))
        )
        await asyncio.wait_for(killed_streaming.wait(), 30)
        # The finished and cancelled sessions are closed; only the long streams' remain.
        for _ in range(200):
            infos = [await worker_info(w) for w in stack.workers]
            if all(info.active_sessions == KILLED for info in infos):
                break
            await asyncio.sleep(0.02)
        stack.coordinator.signal(signal.SIGKILL)
        killed_codes = await asyncio.gather(*long_streams)

    assert short == ["length"] * FINISHED + [2] * CANCELLED
    assert killed_codes == [grpc.StatusCode.UNAVAILABLE] * KILLED, killed_codes
    assert await sessions_left(stack.workers) == {w.name: (0, 0) for w in stack.workers}
    expected = {"done": FINISHED, "cancelled": CANCELLED + KILLED}
    for worker in stack.workers:
        samples = scrape(worker)
        closed = by_label(samples, "outrider_worker_sessions_closed_total", "reason")
        sessions = by_label(
            samples, "outrider_grpc_server_handled_total", "grpc_code", grpc_method="Session"
        )
        print(f"\n{worker.name}: sessions closed {closed}; Session calls by code {sessions}")
        assert samples[("outrider_worker_sessions_opened_total", ())] == 50
        assert closed == expected, (worker.name, closed)
        assert sessions == {"OK": FINISHED, "CANCELLED": CANCELLED + KILLED}, (
            worker.name,
            sessions,
        )
