"""``--plot``: the report as a figure (matplotlib)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from outrider.plotting import pyplot


def plot(report: Mapping[str, Any], path: Path) -> None:
    """Two panels: speedup by configuration (bars by category), and acceptance by configuration."""
    plt = pyplot()
    rows = report["configs"]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(max(11, 0.95 * len(rows) + 4), 10), sharex=True
    )
    _speedup_panel(top, report)
    _acceptance_panel(bottom, rows)
    fig.text(
        0.01,
        0.01,
        "Hugging Face configurations in red, Outrider in black.",
        fontsize=8,
        color="0.3",
    )
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _speedup_panel(top, report: Mapping[str, Any]) -> None:
    """Speedup, one bar per category, the all-prompts bar first and labelled."""
    rows = report["configs"]
    x = list(range(len(rows)))
    groups = [("all prompts", [r["speedup"] for r in rows])] + [
        (f"{c} ({report['prompt_counts'][c]})", [r["by_category"][c]["speedup"] for r in rows])
        for c in report["categories"]
    ]
    width = 0.8 / len(groups)
    for g, (label, values) in enumerate(groups):
        offsets = [i - 0.4 + width * (g + 0.5) for i in x]
        heights = [v or 0 for v in values]
        bars = top.bar(offsets, heights, width, label=label, color="0.2" if g == 0 else None)
        if g == 0:
            top.bar_label(bars, labels=[f"{v:.2f}" for v in heights], fontsize=7, padding=2)
    top.axhline(1.0, color="grey", linewidth=1, linestyle="--")
    top.set_ylabel(f"speedup vs {report['baseline']} (tokens/s ratio)")
    top.set_title(
        f"Speedup by configuration and prompt category — {report.get('title', '')}".rstrip(" —")
    )
    top.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small", title="prompts")
    top.grid(axis="y", alpha=0.3)
    top.set_ylim(0, max([v or 0 for _, values in groups for v in values] + [1.0]) * 1.15)


def _acceptance_panel(bottom, rows: Sequence[Mapping[str, Any]]) -> None:
    """Acceptance rate (left axis) and mean acceptance length (right axis), by
    configuration, Hugging Face's names in red."""
    x = list(range(len(rows)))
    rates = [r["acceptance_rate"] for r in rows]
    lengths = [r["mean_acceptance_length"] or 0 for r in rows]
    rate_bars = bottom.bar([i - 0.2 for i in x], [v or 0 for v in rates], 0.4, color="tab:blue")
    bottom.bar_label(
        rate_bars, labels=["" if v is None else f"{v:.2f}" for v in rates], fontsize=7, padding=2
    )
    bottom.set_ylabel("acceptance rate (accepted / drafted)")
    bottom.set_ylim(0, 1.12)
    right = bottom.twinx()
    length_bars = right.bar([i + 0.2 for i in x], lengths, 0.4, color="tab:orange")
    right.bar_label(length_bars, labels=[f"{v:.2f}" for v in lengths], fontsize=7, padding=2)
    right.set_ylabel("mean acceptance length (tokens / round)")
    right.set_ylim(0, max(lengths + [1]) * 1.12)
    bottom.legend(
        [rate_bars, length_bars], ["acceptance rate", "mean acceptance length"],
        loc="upper left", bbox_to_anchor=(1.06, 1.0), fontsize="small",
    )  # fmt: skip
    bottom.set_title("Acceptance by configuration (no bar: nothing drafted)")
    bottom.set_xticks(x)
    bottom.set_xticklabels([r["name"] for r in rows], rotation=35, ha="right")
    for label, row in zip(bottom.get_xticklabels(), rows, strict=True):
        label.set_color("tab:red" if row["family"] == "hf" else "black")
    bottom.grid(axis="y", alpha=0.3)
