"""``outrider bench pool``: adaptive K against fixed K over several runs of
``outrider bench --concurrency``, their batches pooled.

On a shared machine one configuration's batches differ by up to a fifth
from rotation to rotation, so one run of five decides a few percent either
way. Pooling the batches of several runs' ``--json`` reports (each run's
rotations in turn) gives, for each drafter and concurrency, the adaptive
configuration's mean tok/s over ``outrider-k0``'s and over the best fixed
K's (K = 0 included, the best by its pooled mean), each with a 90% interval
from a bootstrap over the rotations — resampled together for every
configuration, as they ran.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from outrider.bench.configs import TARGET_ONLY
from outrider.bench.options import PoolOptions

HEADER = (
    "| drafter | N | rotations | adaptive tok/s | ÷ outrider-k0 (90%) "
    "| best fixed K | ÷ best fixed K (90%) |\n"
    "|---|---:|---:|---:|---:|---:|---:|"
)

Batches = Mapping[str, Mapping[int, Sequence[float]]]
"""Each configuration's tok/s of every batch, by concurrency."""


def pooled_batches(paths: Sequence[Path]) -> dict[str, dict[int, list[float]]]:
    """Each configuration's tok/s of every batch, by concurrency, the runs in turn."""
    batches: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in paths:
        for config in json.loads(path.read_text())["configs"]:
            for run in config["runs"]:
                repeats = run.get("tokens_per_s_repeats") or [run["tokens_per_s"]]
                batches[config["name"]][run["concurrency"]].extend(repeats)
    return batches


def adaptive_rows(batches: Batches, rng: np.random.Generator, resamples: int) -> list[str]:
    """A table row for each drafter with an adaptive configuration, and each concurrency."""
    drafters = sorted(
        {m[1] for name in batches if (m := re.fullmatch(r"outrider-(.+)-adaptive", name))}
    )
    rows = []
    for drafter in drafters:
        fixed = [TARGET_ONLY] + sorted(
            (n for n in batches if re.fullmatch(rf"outrider-{re.escape(drafter)}-k\d+", n)),
            key=lambda n: int(n.rsplit("-k", 1)[1]),
        )
        adaptive = f"outrider-{drafter}-adaptive"
        for concurrency in sorted(batches[adaptive]):
            names = [*fixed, adaptive]
            table = np.array([batches[name][concurrency] for name in names])  # config × rotation
            rows.append(f"| {drafter} | {concurrency} | {_row(table, names, rng, resamples)} |")
    return rows


def _row(table: np.ndarray, names: Sequence[str], rng: np.random.Generator, resamples: int) -> str:
    """The cells of one drafter at one concurrency, from its configurations' batches (the
    rows of ``table``: ``outrider-k0``, each fixed K, adaptive K last)."""
    means = table.mean(axis=1)
    best = int(np.argmax(means[:-1]))
    picks = rng.integers(0, table.shape[1], size=(resamples, table.shape[1]))
    resampled = table[:, picks].mean(axis=2)  # config × resample
    over_k0 = resampled[-1] / resampled[0]
    over_best = resampled[-1] / resampled[:-1].max(axis=0)
    return (
        f"{table.shape[1]} | {means[-1]:.1f} "
        f"| {means[-1] / means[0]:.2f} ({_interval(over_k0)}) "
        f"| K={names[best].rsplit('-k', 1)[1]} "
        f"| {means[-1] / means[best]:.2f} ({_interval(over_best)})"
    )


def _interval(samples: np.ndarray) -> str:
    low, high = np.quantile(samples, [0.05, 0.95])
    return f"{low:.2f}–{high:.2f}"


def main(options: PoolOptions) -> int:
    """Prints the table; 2 where the reports hold no target-only runs to compare with."""
    batches = pooled_batches(options.reports)
    if TARGET_ONLY not in batches:
        print(f"outrider bench pool: the reports have no {TARGET_ONLY} runs", file=sys.stderr)
        return 2
    print(HEADER)
    for row in adaptive_rows(batches, np.random.default_rng(options.seed), options.resamples):
        print(row)
    return 0
