"""The concurrency report in the terminal: one row per configuration ×
concurrency, then the checks."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from outrider.bench.render import fmt, print_tables

HEADER = [
    "config", "N", "requests", "tok/s", "× N=1", "÷ k0", "TTFT p50 ms", "TTFT ÷ k0", "TTFT p99 ms",
    "ITL p50 ms", "ITL p99 ms", "ITL/token p50 ms", "ITL/token p99 ms", "tok/chunk",
    "accept", "K chosen", "verified", "mismatch",
]  # fmt: skip


def k_shares(distribution: Mapping[str, float] | None) -> str:
    """``K:share`` of the rounds, e.g. ``0:62% 4:38%``."""
    if not distribution:
        return "-"
    return " ".join(f"{k}:{100 * share:.0f}%" for k, share in distribution.items())


def _tokens_per_s(run: Mapping[str, Any]) -> str:
    """Tokens/s, and the range of every repeat where there were several."""
    repeats = run.get("tokens_per_s_repeats")
    if not repeats:
        return fmt(run["tokens_per_s"])
    return f"{fmt(run['tokens_per_s'])} ({fmt(min(repeats))}–{fmt(max(repeats))})"


def _vs_target_only(run: Mapping[str, Any], key: str) -> str:
    """``run[key]`` (a ratio to outrider-k0), and its paired twin where there were repeats."""
    paired = run.get(f"{key}_paired")
    plain = fmt(run.get(key), ".2f", "×")
    return plain if paired is None else f"{plain} ({fmt(paired, '.2f', '×')})"


def table_rows(report: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for config in report["configs"]:
        for r in config["runs"]:
            rows.append(
                [
                    config["name"],
                    str(r["concurrency"]),
                    str(r["requests"]),
                    _tokens_per_s(r),
                    fmt(r["speedup_vs_concurrency_1"], ".2f", "×"),
                    _vs_target_only(r, "vs_target_only"),
                    fmt(r["ttft_ms_p50"], ".1f"),
                    _vs_target_only(r, "ttft_vs_target_only"),
                    fmt(r["ttft_ms_p99"], ".1f"),
                    fmt(r["itl_ms_p50"], ".1f"),
                    fmt(r["itl_ms_p99"], ".1f"),
                    fmt(r["itl_per_token_ms_p50"], ".1f"),
                    fmt(r["itl_per_token_ms_p99"], ".1f"),
                    fmt(r["tokens_per_chunk"]),
                    fmt(r["acceptance_rate"]),
                    k_shares(r.get("k_distribution")),
                    fmt(r.get("verified_fraction")),
                    f"{r['mismatches_vs_reference']}/{r['mismatches_vs_concurrency_1']}",
                ]
            )
    return rows


def headline_lines(report: Mapping[str, Any]) -> list[str]:
    reference = report["mismatch_reference"]
    lines = [
        "tok/s = all streams' generated tokens ÷ wall time of the batch (with --repeat: "
        "the median batch's, every batch's range in brackets; the row is that batch's); "
        "× N=1 = tok/s ÷ tok/s at concurrency 1; ÷ k0 = tok/s (TTFT p50) ÷ "
        "outrider-k0's at the same N, in brackets (with --repeat) the median over the "
        "rotations of a batch's tok/s (TTFT p50) ÷ outrider-k0's batch of the same rotation.",
        "TTFT = request sent → first streamed chunk; ITL = gap between chunks "
        "(Outrider streams a chunk per round, Hugging Face a token per step); "
        "ITL/token = gap ÷ tokens in the chunk; client-side, p50/p99 over the batch.",
        "K chosen = the share of rounds that asked the draft for each K (0: target-only); "
        "verified = draft tokens the target verified ÷ proposed; both over every batch.",
        f"mismatch = requests whose tokens differ from {reference} "
        "/ from the same configuration at N=1.",
    ]
    for name, error in report["not_run"].items():
        lines.append(f"{name}: did not run ({error})")
    mismatches = report["mismatches"]
    if mismatches:
        lines.append(
            f"MISMATCH: {len(mismatches)} (config, concurrency, request) outputs differ: "
            + "; ".join(
                f"{m['config']} at N={m['concurrency']} on {m['prompt']} "
                f"vs {m['reference']} at token {m['first_difference_at']}"
                for m in mismatches[:12]
            )
            + (" …" if len(mismatches) > 12 else "")
        )
    else:
        lines.append(
            "outputs: every configuration at every concurrency produced the same tokens "
            f"as {reference} and as itself at N=1."
        )
    return lines


def render(report: Mapping[str, Any], out=None) -> None:
    print_tables(
        [("per configuration and concurrency", HEADER, table_rows(report))],
        headline_lines(report),
        out or sys.stdout,
    )
