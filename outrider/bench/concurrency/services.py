"""Outrider at concurrency N: N streaming clients taking requests from one
queue, spread round-robin over a drafter's coordinator replicas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from outrider.bench.concurrency.streams import Batch, LoadConfig, Stream, stream_from_arrivals
from outrider.bench.configs import OutriderVariant
from outrider.bench.prompts import Prompt
from outrider.bench.runner import failure_detail


class Replicas:
    """The coordinator replicas in front of one drafter's workers, asked through the asyncio SDK."""

    def __init__(self, addresses: Sequence[str], *, ignore_eos: bool = False) -> None:
        self.addresses = list(addresses)
        self.ignore_eos = ignore_eos

    def run(
        self,
        requests: Sequence[Prompt],
        concurrency: int,
        max_new_tokens: int,
        done: Callable[[int], None],
        *,
        k: int | None,
        adaptive: bool = False,
        pipeline: bool = False,
        temperature: float = 0.0,
    ) -> Batch:
        """N streams at once, taking the requests in order from one queue, each
        as soon as its previous one has ended; stream s uses replica s mod replicas."""
        return asyncio.run(
            self._run(
                requests,
                concurrency,
                max_new_tokens,
                done,
                k=k,
                adaptive=adaptive,
                pipeline=pipeline,
                temperature=temperature,
            )
        )

    async def _run(
        self, requests, concurrency, max_new_tokens, done, *, k, adaptive, pipeline, temperature
    ) -> Batch:
        from outrider.client import AsyncClient

        clients = [AsyncClient(address) for address in self.addresses]
        try:
            # Connect every channel before the clock starts.
            await asyncio.gather(*(client.model_info() for client in clients))
            streams: dict[int, Stream] = {}
            queue = iter(range(len(requests)))  # one event loop: no two streams take the same j

            async def stream(s: int) -> None:
                client = clients[s % len(clients)]
                for j in queue:
                    streams[j] = await self._request(
                        client,
                        requests[j],
                        max_new_tokens,
                        k=k,
                        adaptive=adaptive,
                        pipeline=pipeline,
                        temperature=temperature,
                    )
                    done(1)

            started = time.perf_counter()
            await asyncio.gather(*(stream(s) for s in range(concurrency)))
            wall_s = time.perf_counter() - started
        finally:
            await asyncio.gather(*(client.close() for client in clients))
        return Batch(concurrency, tuple(streams[j] for j in range(len(requests))), wall_s)

    async def _request(
        self,
        client,
        prompt: Prompt,
        max_new_tokens: int,
        *,
        k: int | None,
        adaptive: bool,
        pipeline: bool,
        temperature: float,
    ) -> Stream:
        """One streamed request; a failure names the prompt."""
        token_ids: list[int] = []
        arrivals: list[tuple[float, int]] = []
        stats = None
        sent_s = time.perf_counter()
        try:
            async for chunk in client.stream(
                messages=[{"role": "user", "content": prompt.text}],
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                seed=prompt.seed,
                num_speculative_tokens=k,
                adaptive=adaptive,
                pipeline=pipeline,
                ignore_eos=self.ignore_eos,
            ):
                arrivals.append((time.perf_counter(), len(chunk.token_ids)))
                token_ids += chunk.token_ids
                stats = chunk.stats or stats
        except Exception as exc:
            raise RuntimeError(f"the request for {prompt.id}: {failure_detail(exc)}") from exc
        if stats is None:
            raise RuntimeError(f"the request for {prompt.id}: the stream ended without statistics")
        return stream_from_arrivals(
            token_ids,
            sent_s,
            arrivals,
            rounds=stats.rounds,
            draft_tokens=stats.draft_tokens,
            accepted_tokens=stats.accepted_tokens,
            adaptive=stats.adaptive,
            pipeline=stats.pipeline,
            rounds_by_k=stats.rounds_by_k,
            proposed_tokens=stats.proposed_tokens,
        )


def outrider_load_configs(
    replicas: Mapping[str | None, Replicas], variants: Sequence[OutriderVariant]
) -> list[LoadConfig]:
    """The configurations of the sequential bench (``outrider-k0``, each drafter's K and adaptive K,
    synchronous and pipelined, and the sampled twins), N streams at once, each
    asking its coordinator's replicas."""
    return [
        LoadConfig(
            v.name,
            "outrider",
            partial(
                replicas[v.coordinator].run,
                k=v.k,
                adaptive=v.adaptive,
                pipeline=v.pipeline,
                temperature=v.temperature,
            ),
            v.drafter,
            v.k,
            v.adaptive,
            v.pipeline,
            temperature=v.temperature,
        )
        for v in variants
    ]
