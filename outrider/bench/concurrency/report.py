"""The concurrency report (what ``--json`` writes with ``--concurrency``),
built from the batches (pure)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from outrider.bench.concurrency.streams import Batch, LoadConfig
from outrider.bench.configs import BASELINE, TARGET_ONLY
from outrider.bench.prompts import Prompt
from outrider.bench.report import difference, ratio, round_or_none

DEFINITIONS = {
    "requests": "max(N, prompts) per batch; request j asks prompt j mod prompts; "
    "N streams take them in order from one queue, each its next as soon as its previous ended",
    "tokens_per_s": "all streams' generated tokens / wall time of the batch "
    "(first request sent -> last stream ended); with --repeat, of the batch of median "
    "tokens_per_s, whose figures are the run's",
    "tokens_per_s_repeats": "with --repeat R > 1: tokens_per_s of each of the R batches, "
    "in run order (the batches of one index ran in the same rotation, one after another)",
    "speedup_vs_concurrency_1": "tokens_per_s / tokens_per_s of the same configuration "
    "at concurrency 1",
    "ttft": "client-side, request sent -> first streamed chunk; p50/p99 over the batch's requests",
    "itl": "client-side, between consecutive streamed chunks "
    "(Outrider: a chunk per round; Hugging Face: per token)",
    "itl_per_token": "each chunk gap / tokens in that chunk",
    "percentiles": "linear interpolation between order statistics (numpy's default)",
    "k_distribution": "Outrider: the share of rounds that asked the draft for each K "
    "(K = 0: target-only), as the speculation policy chose; with --repeat, over every batch",
    "verified_fraction": "Outrider: draft tokens the target verified / draft tokens proposed; "
    "with --repeat, over every batch",
    "vs_target_only": "tokens_per_s / tokens_per_s of outrider-k0 at the same concurrency",
    "vs_target_only_paired": "with --repeat R > 1: the median over r of batch r's tokens_per_s "
    "/ outrider-k0's batch r's at the same concurrency (each pair ran in the same rotation, "
    "so a machine that drifts in speed weighs less on it than on vs_target_only)",
    "ttft_ms_p50_repeats": "with --repeat R > 1: ttft_ms_p50 of each of the R batches, "
    "in run order",
    "ttft_vs_target_only_paired": "with --repeat R > 1: the median over r of batch r's "
    "ttft_ms_p50 / outrider-k0's batch r's at the same concurrency",
    "ttft_vs_target_only": "ttft_ms_p50 / ttft_ms_p50 of outrider-k0 at the same concurrency",
}
REQUIRED_RUN_KEYS = (
    "concurrency",
    "tokens_per_s",
    "speedup_vs_concurrency_1",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
    "itl_per_token_ms_p50",
    "itl_per_token_ms_p99",
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0–100), interpolating linearly between order
    statistics; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _ms(seconds: float | None) -> float | None:
    return round_or_none(None if seconds is None else 1000 * seconds, 3)


def summarize_batch(batch: Batch) -> dict[str, Any]:
    """Throughput and latency percentiles of one configuration at one concurrency."""
    streams = batch.streams
    tokens = sum(s.generated_tokens for s in streams)
    ttfts = [s.ttft_s for s in streams]
    gaps = [g for s in streams for g in s.chunk_gaps_s]
    per_token = [
        g / n for s in streams for g, n in zip(s.chunk_gaps_s, s.chunk_tokens, strict=True)
    ]
    chunks = sum(len(s.chunk_gaps_s) + 1 for s in streams)
    rounds = sum(s.rounds for s in streams)
    drafted = sum(s.draft_tokens for s in streams)
    accepted = sum(s.accepted_tokens for s in streams)
    every = sorted((batch, *batch.repeats), key=lambda b: b.index)
    # What the policy chose, over every batch: one batch's would hide the
    # others' (the median batch at K = 0 where the others drafted).
    every_stream = [s for b in every for s in b.streams]
    verified = sum(s.draft_tokens for s in every_stream)
    proposed = sum(s.proposed_tokens for s in every_stream)
    by_k: list[int] = []
    for s in every_stream:
        by_k += [0] * (len(s.rounds_by_k) - len(by_k))
        for k, n in enumerate(s.rounds_by_k):
            by_k[k] += n
    repeats = {}
    if batch.repeats:
        repeats = {
            "tokens_per_s_repeats": [round_or_none(b.tokens_per_s) for b in every],
            "ttft_ms_p50_repeats": [
                _ms(percentile([s.ttft_s for s in b.streams], 50)) for b in every
            ],
        }
    return {
        "concurrency": batch.concurrency,
        "requests": len(streams),
        "generated_tokens": tokens,
        "wall_s": round_or_none(batch.wall_s),
        "tokens_per_s": round_or_none(batch.tokens_per_s),
        "ttft_ms_p50": _ms(percentile(ttfts, 50)),
        "ttft_ms_p99": _ms(percentile(ttfts, 99)),
        "itl_ms_p50": _ms(percentile(gaps, 50)),
        "itl_ms_p99": _ms(percentile(gaps, 99)),
        "itl_per_token_ms_p50": _ms(percentile(per_token, 50)),
        "itl_per_token_ms_p99": _ms(percentile(per_token, 99)),
        "tokens_per_chunk": round_or_none(tokens / chunks if chunks else None),
        "acceptance_rate": round_or_none(accepted / drafted if drafted else None),
        "mean_acceptance_length": round_or_none(tokens / rounds if rounds else None),
        "k_distribution": {str(k): round(n / sum(by_k), 4) for k, n in enumerate(by_k) if n}
        if sum(by_k)
        else None,
        "verified_fraction": round_or_none(verified / proposed if proposed else None),
        **repeats,
    }


def with_speedups(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs of one configuration, each with ``speedup_vs_concurrency_1``
    (None without a run at 1)."""
    one = next((r["tokens_per_s"] for r in runs if r["concurrency"] == 1), None)
    return [
        {**r, "speedup_vs_concurrency_1": round_or_none(ratio(r["tokens_per_s"], one))}
        for r in runs
    ]


def with_target_only_ratios(
    rows: Sequence[dict[str, Any]],
) -> None:
    """Adds to every run ``vs_target_only`` and ``ttft_vs_target_only``: its
    throughput and TTFT p50 ÷ outrider-k0's at the same concurrency (None
    without such a run); with repeats, each paired too (``…_paired``)."""
    target_only = next((row for row in rows if row["name"] == TARGET_ONLY), None)
    by_n = {r["concurrency"]: r for r in target_only["runs"]} if target_only else {}
    for row in rows:
        for run in row["runs"]:
            k0 = by_n.get(run["concurrency"], {})
            run["vs_target_only"] = round_or_none(
                ratio(run["tokens_per_s"], k0.get("tokens_per_s"))
            )
            run["ttft_vs_target_only"] = round_or_none(
                ratio(run["ttft_ms_p50"], k0.get("ttft_ms_p50"))
            )
            for key, repeats in (
                ("vs_target_only_paired", "tokens_per_s_repeats"),
                ("ttft_vs_target_only_paired", "ttft_ms_p50_repeats"),
            ):
                paired = paired_ratio(run.get(repeats), k0.get(repeats))
                if paired is not None:
                    run[key] = round_or_none(paired)


def paired_ratio(mine: Sequence[float] | None, theirs: Sequence[float] | None) -> float | None:
    """The median of ``mine[r] / theirs[r]``: batches of one rotation against
    each other. None unless both ran every repeat (and measured it)."""
    if not mine or not theirs or len(mine) != len(theirs) or not all((*mine, *theirs)):
        return None
    return statistics.median(a / b for a, b in zip(mine, theirs, strict=True))


def find_mismatches(
    batches: Mapping[str, Mapping[int, Batch]], prompts: Sequence[Prompt], reference: str
) -> list[dict[str, Any]]:
    """Every (configuration, concurrency, request) whose tokens differ, on the same prompt, from the
    reference configuration's at concurrency 1, and, at N > 1, from its own at concurrency 1."""
    found = []
    for name, by_concurrency in batches.items():
        for n, median in by_concurrency.items():
            against = [reference]  # (the reference's own repeats at 1 too)
            if n != 1 and name != reference:
                against.append(name)
            streams = [s for batch in (median, *median.repeats) for s in enumerate(batch.streams)]
            for j, stream in streams:
                prompt = j % len(prompts)
                for other in against:
                    theirs = batches[other][1].streams[prompt].token_ids
                    if stream.token_ids == theirs:
                        continue
                    found.append(
                        {
                            "config": name,
                            "concurrency": n,
                            "request": j,
                            "prompt": prompts[prompt].id,
                            "reference": f"{other}@1",
                            **difference(stream.token_ids, theirs),
                        }
                    )
    return found


def build_report(
    configs: Sequence[LoadConfig],
    prompts: Sequence[Prompt],
    batches: Mapping[str, Mapping[int, Batch]],
    not_run: Mapping[str, str] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole report: per configuration, one entry per concurrency; the
    output checks; what did not run."""
    reference = BASELINE if BASELINE in batches else TARGET_ONLY
    sampled = {c.name for c in configs if c.temperature}  # same distribution, other draws
    greedy = {name: b for name, b in batches.items() if name not in sampled}
    mismatches = find_mismatches(greedy, prompts, reference)
    rows = []
    for config in (c for c in configs if c.name in batches):
        runs = with_speedups([summarize_batch(b) for _, b in sorted(batches[config.name].items())])
        for run in runs:
            mine = [
                m
                for m in mismatches
                if m["config"] == config.name and m["concurrency"] == run["concurrency"]
            ]
            # (requests: with --repeat, one may be wrong in several batches)
            run["mismatches_vs_reference"] = len(
                {m["request"] for m in mine if m["reference"] == f"{reference}@1"}
            )
            run["mismatches_vs_concurrency_1"] = len(
                {m["request"] for m in mine if m["reference"] == f"{config.name}@1"}
            )
        rows.append(
            {"name": config.name, "family": config.family, "drafter": config.drafter, "k": config.k,
             "adaptive": config.adaptive, "pipeline": config.pipeline, "runs": runs}
        )  # fmt: skip
    with_target_only_ratios(rows)
    levels = sorted({n for by_concurrency in batches.values() for n in by_concurrency})
    return {
        **(meta or {}),
        "mode": "concurrency",
        "concurrency": levels,
        "definitions": DEFINITIONS,
        "configs": rows,
        "not_run": dict(not_run or {}),
        "mismatch_reference": f"{reference}@1",
        "mismatches": mismatches,
    }
