"""`outrider bench pool`: adaptive against fixed K over several bench runs."""

import json
from pathlib import Path

from outrider.cli import main


def report(path: Path, batches: dict[str, list[float]]) -> Path:
    """A `outrider bench --json` report of one concurrency (4), these batches' tok/s."""
    configs = [
        {"name": name, "runs": [{"concurrency": 4, "tokens_per_s": 0.0, "tokens_per_s_repeats": b}]}
        for name, b in batches.items()
    ]
    path.write_text(json.dumps({"configs": configs}))
    return path


def test_runs_are_pooled_rotation_by_rotation_and_the_best_fixed_k_by_its_mean(tmp_path, capsys):
    first = report(
        tmp_path / "a.json",
        {
            "outrider-k0": [10.0, 10.0],
            "outrider-lookup-k2": [12.0, 8.0],
            "outrider-lookup-k4": [11.0, 11.0],
            "outrider-lookup-adaptive": [12.0, 12.0],
        },
    )
    second = report(
        tmp_path / "b.json",
        {
            "outrider-k0": [20.0],
            "outrider-lookup-k2": [24.0],
            "outrider-lookup-k4": [21.0],
            "outrider-lookup-adaptive": [18.0],
        },
    )
    assert main(["bench", "pool", str(first), str(second), "--resamples", "200"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines()[2:]]
    assert len(rows) == 1
    drafter, n, rotations, tok_s, over_k0, best, over_best = (cell.strip() for cell in rows[0])
    # Means over three rotations: k0 13.33, K=2 14.67, K=4 14.33, adaptive 14.
    assert (drafter, n, rotations, tok_s, best) == ("lookup", "4", "3", "14.0", "K=2")
    assert over_k0.startswith("1.05 (") and over_best.startswith("0.95 (")


def test_reports_without_target_only_runs_are_refused(tmp_path, capsys):
    only = report(tmp_path / "a.json", {"outrider-lookup-adaptive": [1.0]})
    returncode = main(["bench", "pool", str(only)])
    assert returncode == 2 and "no outrider-k0 runs" in capsys.readouterr().err
