"""`outrider bench` end to end on the tiny float64 target: real services started
as processes, Hugging Face in the bench process, JSON and PNG written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from outrider.bench.report import REQUIRED_CONFIG_KEYS


@pytest.mark.timeout(180)
def test_bench_runs_every_configuration_and_writes_json_and_plot(tiny_target_dir: Path, tmp_path: Path):
    pytest.importorskip("matplotlib")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"turns": ["The quick brown fox jumps over the lazy dog. The dog"], "category": "writing"})
        + "\n"
        + json.dumps({"prompt": "def add(a, b):\n    return a + b\n"})
        + "\n"
    )
    out = subprocess.run(
        [
            sys.executable, "-m", "outrider", "bench",
            "--prompts", str(prompts), "--target-model", str(tiny_target_dir), "--dtype", "float64",
            "--max-new-tokens", "8", "--k", "4", "--drafters", "prompt-lookup", "--threads", "1",
            "--json", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "bench.png"), "--no-progress",
        ],
        capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]

    report = json.loads((tmp_path / "bench.json").read_text())
    names = [c["name"] for c in report["configs"]]
    assert names[0] == "hf-generate"
    assert {"outrider-k0", "outrider-prompt-lookup-k4", "outrider-prompt-lookup-adaptive"} <= set(names)
    assert "hf-assisted-prompt-lookup-k4" in names
    for config in report["configs"]:
        assert set(REQUIRED_CONFIG_KEYS) <= config.keys()
        assert config["generated_tokens"] > 0 and config["tokens_per_s"] > 0
        assert set(config["by_category"]) == {"writing", "prompts"}
    rows = {c["name"]: c for c in report["configs"]}
    assert rows["hf-generate"]["speedup"] == 1.0
    assert rows["outrider-prompt-lookup-k4"]["bound_speedup"] > 0
    assert rows["outrider-k0"]["overhead_ms_per_round"] > 0
    # float64 models: every configuration gives hf-generate's tokens.
    assert report["mismatches"] == []
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert "hf-generate" in out.stdout and "speedup = tokens/s" in out.stdout
