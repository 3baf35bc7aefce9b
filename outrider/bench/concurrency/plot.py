"""``--plot`` with ``--concurrency``: throughput and latency against
concurrency, per configuration."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from outrider.plotting import pyplot


def plot(report: Mapping[str, Any], path: Path) -> None:
    """Three panels over N on a log-2 axis: total tokens/s; TTFT p50 and
    p99; ITL per token p50 and p99."""
    plt = pyplot()
    from matplotlib import ticker

    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(11, 13), sharex=True)
    for config in report["configs"]:
        runs = config["runs"]
        n = [r["concurrency"] for r in runs]
        style = "--" if config["family"] == "hf" else "-"
        (line,) = top.plot(
            n, _values(runs, "tokens_per_s"), style, marker="o", label=config["name"]
        )
        for panel, key in ((middle, "ttft_ms"), (bottom, "itl_per_token_ms")):
            panel.plot(n, _values(runs, f"{key}_p50"), style, marker="o", color=line.get_color())
            panel.plot(n, _values(runs, f"{key}_p99"), ":", marker="x", color=line.get_color())

    top.set_ylabel("total tokens/s (all streams)")
    top.set_title(f"Throughput and latency by concurrency — {report.get('title', '')}".rstrip(" —"))
    top.legend(
        loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small", title="configuration"
    )
    middle.set_ylabel("TTFT ms (o p50, x p99)")
    bottom.set_ylabel("inter-token latency per token ms (o p50, x p99)")
    for panel in (middle, bottom):
        if not any(
            v > 0 for line in panel.get_lines() for v in line.get_ydata()
        ):  # NaN > 0 is False
            continue  # nothing to put on a log axis (streams of one chunk have no gap)
        panel.set_yscale("log")
        panel.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        panel.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    for panel in (top, middle, bottom):
        panel.set_xscale("log", base=2)
        panel.grid(alpha=0.3, which="both")
    bottom.set_xticks(report["concurrency"])
    bottom.set_xticklabels([str(n) for n in report["concurrency"]])
    bottom.set_xlabel("concurrent streams N")
    fig.text(
        0.01, 0.01, "Hugging Face dashed, Outrider solid; p99 dotted.", fontsize=8, color="0.3"
    )
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _values(runs, key: str) -> list[float]:
    """A column of the runs, None (no value: a stream of one chunk has no gap) as NaN (no point)."""
    return [float("nan") if r[key] is None else r[key] for r in runs]
