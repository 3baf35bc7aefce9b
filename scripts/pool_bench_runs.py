"""Adaptive K against fixed K over several runs of ``outrider bench --concurrency``.

On a shared machine one configuration's batches differ by up to a fifth
from rotation to rotation, so one run of five decides a few percent
either way. This pools the batches of several runs' ``--json`` reports
(each run's rotations in turn) and prints, for each drafter and
concurrency, the adaptive configuration's mean tok/s over
``outrider-k0``'s and over the best fixed K's (K = 0 included, the best
by its pooled mean), each with a 90% interval from a bootstrap over the
rotations — resampled together for every configuration, as they ran::

    .venv/bin/python scripts/pool_bench_runs.py docs/results/under-load-cpu.json
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

TARGET_ONLY = "outrider-k0"


def pooled_batches(paths: list[Path]) -> dict[str, dict[int, list[float]]]:
    """Each configuration's tok/s of every batch, by concurrency, the runs in turn."""
    batches: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in paths:
        for config in json.loads(path.read_text())["configs"]:
            for run in config["runs"]:
                repeats = run.get("tokens_per_s_repeats") or [run["tokens_per_s"]]
                batches[config["name"]][run["concurrency"]].extend(repeats)
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="+", type=Path, help="`outrider bench --json` reports")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    args = parser.parse_args()
    batches = pooled_batches(args.reports)
    if TARGET_ONLY not in batches:
        parser.error(f"the reports have no {TARGET_ONLY} runs")
    rng = np.random.default_rng(args.seed)
    drafters = sorted(
        {m[1] for name in batches if (m := re.fullmatch(r"outrider-(.+)-adaptive", name))}
    )
    print(
        "| drafter | N | rotations | adaptive tok/s | ÷ outrider-k0 (90%) "
        "| best fixed K | ÷ best fixed K (90%) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for drafter in drafters:
        fixed = [TARGET_ONLY] + sorted(
            (n for n in batches if re.fullmatch(rf"outrider-{re.escape(drafter)}-k\d+", n)),
            key=lambda n: int(n.rsplit("-k", 1)[1]),
        )
        adaptive = f"outrider-{drafter}-adaptive"
        for concurrency in sorted(batches[adaptive]):
            names = [*fixed, adaptive]
            table = np.array([batches[name][concurrency] for name in names])  # config × rotation
            means = table.mean(axis=1)
            best = int(np.argmax(means[:-1]))
            picks = rng.integers(0, table.shape[1], size=(args.resamples, table.shape[1]))
            resampled = table[:, picks].mean(axis=2)  # config × resample
            over_k0 = resampled[-1] / resampled[0]
            over_best = resampled[-1] / resampled[:-1].max(axis=0)
            print(
                f"| {drafter} | {concurrency} | {table.shape[1]} | {means[-1]:.1f} "
                f"| {means[-1] / means[0]:.2f} ({_interval(over_k0)}) "
                f"| K={names[best].rsplit('-k', 1)[1]} "
                f"| {means[-1] / means[best]:.2f} ({_interval(over_best)}) |"
            )


def _interval(samples: np.ndarray) -> str:
    low, high = np.quantile(samples, [0.05, 0.95])
    return f"{low:.2f}–{high:.2f}"


if __name__ == "__main__":
    main()
