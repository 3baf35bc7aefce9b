"""``outrider bench prefix``: what the prefix cache saves, with the cache on
and off in one run, and what prefix-aware routing finds over two target
replicas (what it starts and sends: :class:`outrider.bench.options.PrefixOptions`).

Workloads, all chat requests through the gRPC SDK, each turn resending the
whole conversation:

* ``system``: a ~1k-token system prompt (one of the shipped long-context
  prompts) in front of short MT-Bench questions, one turn each; one request
  before the measured ones puts the system prompt in the cache, as a
  deployment's is.
* ``mt-bench``: MT-Bench's two turns, the second after the model's answer.
* ``chat-4``: conversations of four MT-Bench questions of one category,
  each after the answers to the ones before.

A request's time to first token runs from its sending to its first chunk.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

from outrider.bench.concurrency.report import percentile
from outrider.bench.options import PrefixOptions
from outrider.bench.prompts import DATA_DIR

OPENED = "outrider_worker_sessions_opened_total"
Conversation = list[str]
"""A conversation's user turns (the first may come after a system prompt)."""


@dataclass(frozen=True)
class Workload:
    name: str
    conversations: list[Conversation]
    system: str | None = None


@dataclass
class Turn:
    """One request: when its first chunk came, what it streamed, its prompt's cache hits."""

    ttft_s: float
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Run:
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t.token_ids) for t in self.turns) / self.wall_s

    @property
    def hit_rate(self) -> float:
        return sum(t.cached_tokens for t in self.turns) / sum(t.prompt_tokens for t in self.turns)


def _rows(path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def system_prompts() -> list[str]:
    """The shipped long-context prompts of about 1k tokens."""
    rows = _rows(DATA_DIR / "long_context" / "long_context.jsonl")
    return [row["prompt"] for row in rows if row["category"].endswith("-1k")]


def workloads(options: PrefixOptions) -> list[Workload]:
    questions = _rows(DATA_DIR / "mt_bench" / "question.jsonl")
    step = max(1, len(questions) // options.conversations)
    chosen = questions[::step][: options.conversations]
    by_category = [
        [row["turns"][0] for row in rows]
        for _, rows in groupby(questions, key=lambda row: row["category"])
    ]
    return [
        Workload("system", [[row["turns"][0]] for row in chosen], system=system_prompts()[0]),
        Workload("mt-bench", [list(row["turns"][:2]) for row in chosen]),
        Workload(
            "chat-4", [c[i : i + 4] for c in by_category for i in (0, 4)][: options.conversations]
        ),
    ]


async def converse(
    client, conversation: Conversation, system: str | None, max_tokens: int
) -> list[Turn]:
    """The conversation's turns one after another, each resending the history."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    turns = []
    for question in conversation:
        messages.append({"role": "user", "content": question})
        sent, first, text, ids, stats = time.perf_counter(), None, [], [], None
        async for chunk in client.stream(messages=list(messages), max_new_tokens=max_tokens):
            first = first or time.perf_counter()
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            stats = chunk.stats or stats
        assert first is not None and stats is not None  # a stream ends with its statistics
        turns.append(Turn(first - sent, ids, stats.prompt_tokens, stats.cached_prompt_tokens))
        messages.append({"role": "assistant", "content": "".join(text)})
    return turns


async def run_workload(address: str, workload: Workload, streams: int, max_tokens: int) -> Run:
    """Every conversation of ``workload``, ``streams`` at once."""
    from outrider.client import AsyncClient

    async with AsyncClient(address, timeout=600) as client:
        if workload.system is not None:  # the deployment's system prompt, cached
            await converse(client, ["Hello."], workload.system, 1)
        semaphore = asyncio.Semaphore(streams)

        async def one(conversation: Conversation) -> list[Turn]:
            async with semaphore:
                return await converse(client, conversation, workload.system, max_tokens)

        started = time.perf_counter()
        done = await asyncio.gather(*(one(c) for c in workload.conversations))
        return Run([t for turns in done for t in turns], time.perf_counter() - started)


def _worker_args(options: PrefixOptions, caching: bool) -> list[str]:
    args = ["--log-level", "warning", "--max-sessions", "64"]
    if options.threads is not None:
        args += ["--threads", str(options.threads)]
    return [*args, f"--{'' if caching else 'no-'}enable-prefix-caching"]


def _draft_args(options: PrefixOptions, caching: bool) -> list[str] | None:
    if options.drafter == "prompt-lookup":
        return None
    return [*_worker_args(options, caching), "--drafter", options.drafter]


def cache_runs(options: PrefixOptions, bar) -> dict[tuple[str, int, bool], Run]:
    """Each workload at each concurrency, on a stack with the cache and one without."""
    from outrider.stack import start_stack

    runs = {}
    for caching in (True, False):
        draft = _draft_args(options, caching)
        coordinator = ["--log-level", "warning"]
        if draft is None:
            coordinator.append("--prompt-lookup")
        with start_stack(
            target_args=_worker_args(options, caching),
            draft_args=draft or (),
            coordinator_args=coordinator,
            with_draft=draft is not None,
        ) as stack:
            address = stack.coordinator.address
            for workload in workloads(options):
                for n in options.concurrency:
                    runs[workload.name, n, caching] = asyncio.run(
                        run_workload(address, workload, n, options.max_tokens)
                    )
                    bar.update()
    return runs


def routing_runs(options: PrefixOptions, bar) -> dict[str, tuple[Run, list[float]]]:
    """16 streams over 4 system prompts on two target replicas (prompt
    lookup: no draft), routed by prefix and by load, after one request per
    system prompt; each request's system prompt drawn at random (seeded);
    each run's turns and the sessions each replica opened."""
    import tempfile
    from pathlib import Path

    from outrider.stack import Stack

    results = {}
    for routing in ("prefix", "least-loaded"):
        with Stack(workdir=Path(tempfile.mkdtemp(prefix="outrider-bench-"))) as stack:
            target_args = _worker_args(options, True)
            if options.routing_cache_tokens is not None:
                target_args += ["--max-cached-tokens", str(options.routing_cache_tokens)]
            targets = [
                stack.start(
                    "target", target_args, timeout_s=300, label=f"target-{i}", metrics_port=0
                )
                for i in range(2)
            ]
            stack.start(
                "coordinator",
                [
                    "--target", ",".join(t.address for t in targets), "--prompt-lookup",
                    "--routing", routing, "--log-level", "warning",
                ],
                timeout_s=300,
            )  # fmt: skip
            run = asyncio.run(routed_streams(stack.coordinator.address, options))
            results[routing] = (run, [_counter(t.metrics_url, OPENED) for t in targets])
            bar.update()
    return results


async def routed_streams(address: str, options: PrefixOptions) -> Run:
    """One request per system prompt, then the 16 streams."""
    from outrider.client import AsyncClient

    systems = system_prompts()
    questions = [row["turns"][0] for row in _rows(DATA_DIR / "mt_bench" / "question.jsonl")]
    async with AsyncClient(address, timeout=600) as client:
        for system in systems:
            await converse(client, ["Hello."], system, 1)

        async def stream(i: int) -> list[Turn]:
            turns, rng = [], random.Random(i)
            for j in range(options.routing_requests):
                question = questions[(i * options.routing_requests + j) % len(questions)]
                turns += await converse(client, [question], rng.choice(systems), options.max_tokens)
            return turns

        started = time.perf_counter()
        done = await asyncio.gather(*(stream(i) for i in range(16)))
        return Run([t for ts in done for t in ts], time.perf_counter() - started)


def _counter(url: str | None, name: str) -> float:
    assert url is not None  # started with a metrics port
    with urllib.request.urlopen(url, timeout=10) as response:  # 127.0.0.1 only
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def quantiles(values: Sequence[float]) -> tuple[float, float]:
    return percentile(values, 50) or 0.0, percentile(values, 99) or 0.0


def cache_report(runs: dict[tuple[str, int, bool], Run]) -> str:
    lines = [
        "| workload | N | cache | TTFT p50 | TTFT p99 "
        "| TTFT p50 of turns with a cached prefix (off: all) | tok/s "
        "| prompt tokens cached | TTFT p50 on ÷ off |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    names = sorted({(w, n) for w, n, _ in runs}, key=lambda wn: (wn[0] != "system", wn))
    for workload, n in names:
        off50 = quantiles([t.ttft_s for t in runs[workload, n, False].turns])[0]
        for caching in (True, False):
            run = runs[workload, n, caching]
            p50, p99 = quantiles([t.ttft_s for t in run.turns])
            hit = [t.ttft_s for t in run.turns if t.cached_tokens or not caching]
            ratio = f"{p50 / off50:.2f}" if caching else ""
            lines.append(
                f"| {workload} | {n} | {'on' if caching else 'off'} | {p50 * 1e3:.0f} ms "
                f"| {p99 * 1e3:.0f} ms | {quantiles(hit)[0] * 1e3:.0f} ms "
                f"| {run.tokens_per_s:.1f} | {run.hit_rate:.0%} | {ratio} |"
            )
    same = all(
        [t.token_ids for t in runs[w, n, True].turns]
        == [t.token_ids for t in runs[w, n, False].turns]
        for w, n in names
    )
    lines.append(f"\noutputs identical with the cache on and off: {'yes' if same else 'NO'}")
    return "\n".join(lines)


def routing_report(results: dict[str, tuple[Run, list[float]]]) -> str:
    lines = [
        "| routing | prompt tokens cached | TTFT p50 | TTFT p99 | tok/s | sessions per replica |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for routing, (run, opened) in results.items():
        p50, p99 = quantiles([t.ttft_s for t in run.turns])
        lines.append(
            f"| {routing} | {run.hit_rate:.0%} | {p50 * 1e3:.0f} ms | {p99 * 1e3:.0f} ms "
            f"| {run.tokens_per_s:.1f} | {' / '.join(f'{o:.0f}' for o in opened)} |"
        )
    return "\n".join(lines)


def main(options: PrefixOptions) -> int:
    from tqdm import tqdm

    caching, routing = options.part in ("all", "cache"), options.part in ("all", "routing")
    total = caching * 2 * 3 * len(options.concurrency) + routing * 2
    load = [os.getloadavg()[0]]
    with tqdm(total=total, desc="runs", unit="run", disable=options.no_progress) as bar:
        cached = cache_runs(options, bar) if caching else {}
        routed = routing_runs(options, bar) if routing else {}
    load.append(os.getloadavg()[0])
    if cached:
        print(cache_report(cached))
    if routed:
        print(("\n" if cached else "") + routing_report(routed))
    print(f"\nload average (1 min) at start and end: {load[0]:.2f}, {load[1]:.2f}")
    if options.json is not None:
        summary = {
            "cache": {
                f"{w}/{n}/{'on' if c else 'off'}": {
                    "ttft_s_p50_p99": quantiles([t.ttft_s for t in run.turns]),
                    "tokens_per_s": run.tokens_per_s,
                    "hit_rate": run.hit_rate,
                }
                for (w, n, c), run in cached.items()
            },
            "routing": {
                r: {"hit_rate": run.hit_rate, "sessions": opened}
                for r, (run, opened) in routed.items()
            },
        }
        options.json.write_text(json.dumps(summary, indent=2))
    return 0
