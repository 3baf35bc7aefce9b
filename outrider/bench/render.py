"""The report in the terminal: tables and the headline, with rich when it is installed."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from outrider.bench.configs import SAMPLED, TARGET_ONLY


def fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:{spec}}{suffix}"


def _histogram(row: Mapping[str, Any], width: int = 8) -> str:
    """Accepted per position as a fraction of rounds: ``.91 .80 .62 ...``."""
    rounds = row["rounds"]
    if not row["accepted_per_position"] or not rounds:
        return "-"
    shares = [f"{n / rounds:.2f}".lstrip("0") for n in row["accepted_per_position"][:width]]
    more = " …" if len(row["accepted_per_position"]) > width else ""
    return " ".join(shares) + more


def _hits(row: Mapping[str, Any]) -> str:
    """A pipelined configuration's hit rate and its hits/misses:
    ``.62 (31/19)``; ``-`` when synchronous."""
    if not row.get("pipeline"):
        return "-"
    rate = (
        "-"
        if row["speculation_hit_rate"] is None
        else f"{row['speculation_hit_rate']:.2f}".lstrip("0")
    )
    return f"{rate} ({row['speculation_hits']}/{row['speculation_misses']})"


def table_rows(report: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = [
        "config", "tok/s", "speedup", "accept", "MAL", "E", "draft ms", "verify ms",
        "overhead ms p50", "critical path ms p50", "hit rate (hits/misses)", "bound",
        "achieved/bound", "mismatch", "accepted per position (share of rounds)",
    ]  # fmt: skip
    rows = []
    for r in report["configs"]:
        rows.append(
            [
                r["name"],
                fmt(r["tokens_per_s"]),
                fmt(r["speedup"], ".2f", "×"),
                fmt(r["acceptance_rate"]),
                fmt(r["mean_acceptance_length"]),
                fmt(r["expected_tokens_per_round"]),
                fmt(r["draft_ms_per_round"], ".1f"),
                fmt(r["verify_ms_per_round"], ".1f"),
                fmt(r["overhead_ms_per_round"], ".2f"),
                fmt(r["critical_path_ms_p50"], ".2f"),
                _hits(r),
                fmt(r["bound_speedup"], ".2f", "×"),
                fmt(r["achieved_over_bound"]),
                str(r["mismatches"]),
                _histogram(r),
            ]
        )
    return header, rows


def category_rows(report: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["config"] + [f"{c} ({report['prompt_counts'][c]})" for c in report["categories"]]
    rows = []
    for r in report["configs"]:
        cells = [r["name"]]
        for c in report["categories"]:
            s = r["by_category"][c]
            cell = f"{fmt(s['tokens_per_s'], '.1f')} t/s {fmt(s['speedup'], '.2f', '×')}"
            if s["acceptance_rate"] is not None:
                cell += f" α{fmt(s['acceptance_rate'])} L{fmt(s['mean_acceptance_length'])}"
            cells.append(cell)
        rows.append(cells)
    return header, rows


def headline_lines(report: Mapping[str, Any]) -> list[str]:
    h = report["headline"]
    lines = [
        f"speedup = tokens/s ÷ tokens/s of {report['baseline']}; greedy, same prompts, interleaved."
    ]
    if report.get("repeat", 1) > 1:
        lines.append(
            f"each prompt ran {report['repeat']} times per configuration; "
            "each figure is of its request of median wall time."
        )
    if h["best_outrider"] and h["best_hf_assisted"]:
        lines.append(
            f"best Outrider ({h['best_outrider']}) ÷ best HF assisted ({h['best_hf_assisted']}): "
            f"{fmt(h['best_outrider_over_best_hf_assisted'], '.2f', '×')}"
        )
    if h["outrider_k0_over_hf_generate"] is not None:
        verdict = "within 5%" if h["outrider_k0_within_5pct_of_hf_generate"] else "NOT within 5%"
        lines.append(
            f"outrider-k0 ÷ hf-generate: {h['outrider_k0_over_hf_generate']:.3f} ({verdict})"
        )
    if h["achieved_over_bound"]:
        parts = ", ".join(f"{n} {v:.2f}" for n, v in h["achieved_over_bound"].items())
        lines.append(f"achieved/bound (vs outrider-k0): {parts}")
    if h["max_overhead_ms_per_round_p50"] is not None:
        lines.append(
            "overhead per round (RPC + coordinator), p50, worst config: "
            f"{h['max_overhead_ms_per_round_p50']:.2f} ms"
        )
    if h.get("sampled_over_target_only"):
        parts = ", ".join(f"{n} {fmt(v)}" for n, v in h["sampled_over_target_only"].items())
        lines.append(f"sampled (temperature 1) ÷ {TARGET_ONLY}{SAMPLED}: {parts}")
    if h.get("pipelined_over_synchronous"):
        parts = ", ".join(
            f"{n} {fmt(v['tokens_per_s'])} "
            f"(critical path p50 {fmt(v['critical_path_ms_p50'][0])} → "
            f"{fmt(v['critical_path_ms_p50'][1])} ms)"
            for n, v in h["pipelined_over_synchronous"].items()
        )
        lines.append(f"pipelined ÷ synchronous tokens/s: {parts}")
    if report["mismatches"]:
        lines.append(
            f"MISMATCH: {len(report['mismatches'])} (config, prompt) outputs differ "
            f"from {report['mismatch_reference']}: "
            + "; ".join(
                f"{m['config']} on {m['prompt']} at token {m['first_difference_at']}"
                for m in report["mismatches"][:12]
            )
            + (" …" if len(report["mismatches"]) > 12 else "")
        )
    else:
        lines.append(
            "outputs: every configuration produced the same tokens as "
            f"{report['mismatch_reference']} on every prompt."
        )
    if any(r["family"] == "llama.cpp" for r in report["configs"]):
        lines.append("llama.cpp's outputs are not compared: another engine, other numerics.")
    return lines


def render(report: Mapping[str, Any], out=None) -> None:
    """The tables and the headline, with rich when it is installed, else plain text."""
    tables = [("per configuration", *table_rows(report)), ("per category", *category_rows(report))]
    print_tables(tables, headline_lines(report), out or sys.stdout)


def print_tables(
    tables: Sequence[tuple[str, list[str], list[list[str]]]], lines: Sequence[str], out
) -> None:
    """(title, header, rows) tables, then lines; rows with a non-zero ``mismatch`` cell and lines
    starting with MISMATCH in bold red (with rich when it is installed, else plain text)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for title, header, rows in tables:
            print(f"\n{title}", file=out)
            print(_plain_table(header, rows), file=out)
        for line in lines:
            print(line, file=out)
        return
    console = Console(file=out, width=None if out.isatty() else 260, highlight=False)
    for title, header, rows in tables:
        table = Table(title=title, title_justify="left")
        for i, name in enumerate(header):
            table.add_column(
                name, justify="left" if i == 0 or name.startswith("accepted") else "right"
            )
        column = header.index("mismatch") if "mismatch" in header else None
        for row in rows:
            mismatch = column is not None and any(c in "123456789" for c in row[column])
            table.add_row(*row, style="bold red" if mismatch else None)
        console.print(table)
    for line in lines:
        console.print(line, style="bold red" if line.startswith("MISMATCH") else None)


def _plain_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True))
        for line in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
