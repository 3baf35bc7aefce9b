"""The report (what ``--json`` writes), built from the measurements (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from outrider.bench.bound import analytic_bound
from outrider.bench.configs import BASELINE, PIPELINED, SAMPLED, TARGET_ONLY, Config
from outrider.bench.measurements import Measurement, Totals, aggregate
from outrider.bench.prompts import Prompt

REQUIRED_CONFIG_KEYS = (
    "name",
    "tokens_per_s",
    "speedup",
    "acceptance_rate",
    "mean_acceptance_length",
    "bound_speedup",
    "overhead_ms_per_round",
    "critical_path_ms_p50",
    "pipeline",
    "speculation_hit_rate",
)


def first_difference(mine: Sequence[int], theirs: Sequence[int]) -> int:
    """The index of the first token that differs (the shorter length when one
    is a prefix of the other)."""
    return next(
        (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
        min(len(mine), len(theirs)),
    )


def difference(mine: Sequence[int], theirs: Sequence[int]) -> dict[str, int]:
    """A mismatch's account of two outputs: where they part, and their lengths."""
    return {
        "first_difference_at": first_difference(mine, theirs),
        "tokens": len(mine),
        "reference_tokens": len(theirs),
    }


def find_mismatches(
    results: Mapping[str, Sequence[Measurement]], prompts: Sequence[Prompt], reference: str
) -> list[dict[str, Any]]:
    """Every (configuration, prompt) whose tokens differ from the reference's,
    in any of its repeats (the reference's own repeats against its median)."""
    found = []
    for name, measurements in results.items():
        for prompt, median, theirs in zip(prompts, measurements, results[reference], strict=True):
            runs = median.repeats if name == reference else (median, *median.repeats)
            mine = next((m for m in runs if m.token_ids != theirs.token_ids), None)
            if mine is None:
                continue
            found.append(
                {
                    "config": name,
                    "prompt": prompt.id,
                    **difference(mine.token_ids, theirs.token_ids),
                    "prompt_tokens": mine.prompt_tokens,
                    "reference_prompt_tokens": theirs.prompt_tokens,
                }
            )
    return found


def round_or_none(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def milliseconds(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def summarize_config(
    config: Config, totals: Totals, baseline: Totals, target_only: Totals | None
) -> dict[str, Any]:
    """One entry of the report's ``configs``."""
    outrider = config.family == "outrider"
    bound = (
        analytic_bound(totals, target_only, pipelined=config.pipeline)
        if outrider and target_only
        else None
    )
    achieved = (
        ratio(totals.tokens_per_s, target_only.tokens_per_s) if target_only and outrider else None
    )
    row = {
        "name": config.name,
        "family": config.family,
        "drafter": config.drafter,
        "k": config.k,
        "adaptive": config.adaptive,
        "pipeline": config.pipeline,
        "prompts": totals.prompts,
        "generated_tokens": totals.generated_tokens,
        "wall_s": round_or_none(totals.wall_s),
        "tokens_per_s": round_or_none(totals.tokens_per_s),
        "speedup": round_or_none(ratio(totals.tokens_per_s, baseline.tokens_per_s)),
        "acceptance_rate": round_or_none(totals.acceptance_rate),
        "mean_acceptance_length": round_or_none(totals.mean_acceptance_length),
        "rounds": totals.rounds,
        "draft_tokens": totals.draft_tokens,
        "accepted_tokens": totals.accepted_tokens,
        "num_drafts": totals.num_drafts,
        "accepted_per_position": list(totals.accepted_per_position),
        "speculation_hits": totals.speculation_hits if config.pipeline else None,
        "speculation_misses": totals.speculation_misses if config.pipeline else None,
        "speculation_hit_rate": round_or_none(totals.speculation_hit_rate)
        if config.pipeline
        else None,
        "draft_ms_per_round": round_or_none(totals.per_round_ms(totals.draft_time_s), 3),
        "verify_ms_per_round": round_or_none(totals.per_round_ms(totals.verify_time_s), 3),
        "overhead_mean_ms_per_round": round_or_none(totals.per_round_ms(totals.overhead_time_s), 3),
        "overhead_ms_per_round": round_or_none(milliseconds(totals.overhead_s_p50), 3),
        "critical_path_ms_p50": round_or_none(milliseconds(totals.critical_path_overhead_s_p50), 3),
        "expected_tokens_per_round": round_or_none(
            bound.expected_tokens_per_round if bound else None
        ),
        "mean_draft_tokens_per_round": round_or_none(bound.mean_draft_tokens if bound else None),
        "bound_round_ms": round_or_none(milliseconds(bound.round_time_s) if bound else None, 3),
        "bound_speedup": round_or_none(bound.speedup if bound else None),
        "achieved_speedup_vs_k0": round_or_none(achieved),
        "achieved_over_bound": round_or_none(ratio(achieved, bound.speedup if bound else None)),
    }
    return row


def summarize_category(totals: Totals, baseline: Totals) -> dict[str, Any]:
    return {
        "prompts": totals.prompts,
        "generated_tokens": totals.generated_tokens,
        "wall_s": round_or_none(totals.wall_s),
        "tokens_per_s": round_or_none(totals.tokens_per_s),
        "speedup": round_or_none(ratio(totals.tokens_per_s, baseline.tokens_per_s)),
        "acceptance_rate": round_or_none(totals.acceptance_rate),
        "mean_acceptance_length": round_or_none(totals.mean_acceptance_length),
    }


def sampled_over_target_only(rows: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Each sampled twin's tokens/s ÷ ``outrider-k0-t1``'s."""
    k0 = next((r for r in rows if r["name"] == TARGET_ONLY + SAMPLED), None)
    return {
        r["name"]: round_or_none(ratio(r["tokens_per_s"], k0["tokens_per_s"]))
        for r in rows
        if k0 is not None and r["name"].endswith(SAMPLED) and r is not k0
    }


def headline(rows: Sequence[Mapping[str, Any]], baseline: str) -> dict[str, Any]:
    """Best Outrider vs best HF assisted; outrider-k0 vs hf-generate; achieved/bound; overhead;
    each pipelined configuration vs its synchronous twin (tokens/s, critical path)."""
    by_name = {r["name"]: r for r in rows}
    speculative = [
        r
        for r in rows
        if r["family"] == "outrider"
        and r["name"] != TARGET_ONLY
        and not r["name"].endswith(SAMPLED)
    ]
    assisted = [r for r in rows if r["name"].startswith("hf-assisted")]
    best_outrider = max(speculative, key=lambda r: r["tokens_per_s"], default=None)
    best_hf = max(assisted, key=lambda r: r["tokens_per_s"], default=None)
    k0, hf = by_name.get(TARGET_ONLY), by_name.get(BASELINE)
    bounds = {
        r["name"]: r["achieved_over_bound"]
        for r in rows
        if r.get("achieved_over_bound") is not None
    }
    overheads = [
        r["overhead_ms_per_round"]
        for r in rows
        if r["family"] == "outrider" and r["overhead_ms_per_round"] is not None
    ]
    k0_vs_hf = ratio(k0["tokens_per_s"], hf["tokens_per_s"]) if k0 and hf else None
    return {
        "baseline": baseline,
        "best_outrider": best_outrider["name"] if best_outrider else None,
        "best_hf_assisted": best_hf["name"] if best_hf else None,
        "best_outrider_over_best_hf_assisted": round_or_none(
            ratio(best_outrider["tokens_per_s"], best_hf["tokens_per_s"])
            if best_outrider and best_hf
            else None
        ),
        "outrider_k0_over_hf_generate": round_or_none(k0_vs_hf),
        "outrider_k0_within_5pct_of_hf_generate": None
        if k0_vs_hf is None
        else abs(k0_vs_hf - 1) <= 0.05,
        "achieved_over_bound": bounds,
        "min_achieved_over_bound": min(bounds.values(), default=None),
        "max_overhead_ms_per_round_p50": max(overheads, default=None),
        "sampled_over_target_only": sampled_over_target_only(rows),
        "pipelined_over_synchronous": pipelined_over_synchronous(rows),
    }


def pipelined_over_synchronous(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each pipelined configuration against its synchronous twin: tokens/s,
    and the critical path's p50 of both."""
    by_name = {r["name"]: r for r in rows}
    found = {}
    for row in rows:
        twin = by_name.get(row["name"].removesuffix(PIPELINED)) if row.get("pipeline") else None
        if twin is not None:
            found[row["name"]] = {
                "synchronous": twin["name"],
                "tokens_per_s": round_or_none(ratio(row["tokens_per_s"], twin["tokens_per_s"])),
                "critical_path_ms_p50": [
                    twin["critical_path_ms_p50"],
                    row["critical_path_ms_p50"],
                ],
            }
    return found


def build_report(
    configs: Sequence[Config],
    prompts: Sequence[Prompt],
    results: Mapping[str, Sequence[Measurement]],
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole report (what ``--json`` writes): pure, from the measurements."""
    baseline = BASELINE if BASELINE in results else TARGET_ONLY
    categories = sorted({p.category for p in prompts})

    def totals_of(name: str, category: str | None = None) -> Totals:
        return aggregate(
            [
                m
                for p, m in zip(prompts, results[name], strict=True)
                if category is None or p.category == category
            ]
        )

    base = totals_of(baseline)
    target_only = totals_of(TARGET_ONLY) if TARGET_ONLY in results else None
    rows = []
    for config in configs:
        row = summarize_config(config, totals_of(config.name), base, target_only)
        row["by_category"] = {
            c: summarize_category(totals_of(config.name, c), totals_of(baseline, c))
            for c in categories
        }
        rows.append(row)
    reference = BASELINE if BASELINE in results else TARGET_ONLY
    # Sampled configurations draw other tokens; llama.cpp's computes with other numerics.
    compared = [c.name for c in configs if not c.temperature and c.family != "llama.cpp"]
    mismatches = (
        find_mismatches({n: results[n] for n in compared}, prompts, reference)
        if reference in results
        else []
    )
    for row in rows:
        row["mismatches"] = sum(1 for m in mismatches if m["config"] == row["name"])
    return {
        **(meta or {}),
        "speedup_definition": f"tokens_per_s / tokens_per_s of {baseline}",
        "baseline": baseline,
        "categories": categories,
        "prompt_counts": {c: sum(1 for p in prompts if p.category == c) for c in categories},
        "configs": rows,
        "mismatch_reference": reference,
        "mismatches": mismatches,
        "headline": headline(rows, baseline),
    }
