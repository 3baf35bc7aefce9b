"""`outrider bench` end to end on the tiny float64 target: real services started
as processes, Hugging Face in the bench process, JSON and PNG written; one request
at a time, and `--concurrency`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from outrider.bench.concurrency.report import REQUIRED_RUN_KEYS
from outrider.bench.report import REQUIRED_CONFIG_KEYS


@pytest.mark.timeout(180)
def test_bench_runs_every_configuration_and_writes_json_and_plot(
    tiny_target_dir: Path, tmp_path: Path
):
    pytest.importorskip("matplotlib")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps(
            {
                "turns": ["The quick brown fox jumps over the lazy dog. The dog"],
                "category": "writing",
            }
        )
        + "\n"
        + json.dumps({"prompt": "def add(a, b):\n    return a + b\n"})
        + "\n"
    )
    out = subprocess.run(
        [
            sys.executable, "-m", "outrider", "bench",
            "--prompts", str(prompts), "--target-model", str(tiny_target_dir), "--dtype", "float64",
            "--max-new-tokens", "8", "--k", "4", "--drafters", "prompt-lookup", "--threads", "1",
            "--json", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "bench.png"),
            "--no-progress",
        ],
        capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]

    report = json.loads((tmp_path / "bench.json").read_text())
    names = [c["name"] for c in report["configs"]]
    assert names[0] == "hf-generate"
    assert {"outrider-k0", "outrider-prompt-lookup-k4", "outrider-prompt-lookup-adaptive"} <= set(
        names
    )
    assert not any(name.endswith("-pipelined") for name in names)  # (prompt lookup never is)
    assert "hf-assisted-prompt-lookup-k4" in names
    # Sampled twins at temperature 1: run, compared with target-only sampled, not checked.
    outrider = [name for name in names if name.startswith("outrider")]
    assert outrider[-2:] == ["outrider-k0-t1", "outrider-prompt-lookup-adaptive-t1"]
    sampled = report["headline"]["sampled_over_target_only"]
    assert sampled["outrider-prompt-lookup-adaptive-t1"] > 0
    assert "sampled (temperature 1) ÷ outrider-k0-t1" in out.stdout
    for config in report["configs"]:
        assert set(REQUIRED_CONFIG_KEYS) <= config.keys()
        assert config["generated_tokens"] > 0 and config["tokens_per_s"] > 0
        assert set(config["by_category"]) == {"writing", "prompts"}
    rows = {c["name"]: c for c in report["configs"]}
    assert rows["hf-generate"]["speedup"] == 1.0
    assert rows["outrider-prompt-lookup-k4"]["bound_speedup"] > 0
    assert rows["outrider-k0"]["overhead_ms_per_round"] > 0
    assert rows["outrider-k0"]["critical_path_ms_p50"] > 0
    assert rows["outrider-prompt-lookup-k4"]["pipeline"] is False
    # float64 models: every configuration gives hf-generate's tokens.
    assert report["mismatches"] == []
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert "hf-generate" in out.stdout and "speedup = tokens/s" in out.stdout


@pytest.mark.timeout(120)
def test_bench_concurrency_runs_every_configuration_at_every_concurrency(
    tiny_target_dir: Path, tmp_path: Path
):
    """`--concurrency 1,2` with two coordinator replicas: every request generates exactly
    max_new_tokens (`--ignore-eos`), and float64 gives the same tokens everywhere."""
    pytest.importorskip("matplotlib")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "The quick brown fox jumps over the lazy dog. The dog"})
        + "\n"
        + json.dumps({"prompt": "One two three, one two three, one two"})
        + "\n"
    )
    out = subprocess.run(
        [
            sys.executable, "-m", "outrider", "bench",
            "--prompts", str(prompts), "--target-model", str(tiny_target_dir), "--dtype", "float64",
            "--max-new-tokens", "8", "--k", "4", "--drafters", "prompt-lookup", "--no-adaptive",
            "--threads", "1", "--concurrency", "2", "--coordinators", "2", "--ignore-eos",
            "--device", "cpu", "--json", str(tmp_path / "bench.json"),
            "--plot", str(tmp_path / "bench.png"), "--no-progress",
        ],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]

    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["mode"] == "concurrency" and report["concurrency"] == [1, 2]
    assert report["coordinators"] == 2 and report["ignore_eos"] is True
    names = [c["name"] for c in report["configs"]]
    assert names[:3] == ["hf-generate", "outrider-k0", "outrider-prompt-lookup-k4"]
    # transformers' continuous batching either ran or says why not.
    assert ("hf-generate-batch" in names) != ("hf-generate-batch" in report["not_run"])
    for config in report["configs"]:
        assert [r["concurrency"] for r in config["runs"]] == [1, 2]
        for run in config["runs"]:
            assert set(REQUIRED_RUN_KEYS) <= run.keys()
            assert run["requests"] == 2  # max(N, 2 prompts)
            assert run["generated_tokens"] == 2 * 8  # fixed length
            assert (
                run["tokens_per_s"] > 0
                and run["ttft_ms_p50"] > 0
                and run["itl_per_token_ms_p99"] > 0
            )
        assert config["runs"][0]["speedup_vs_concurrency_1"] == 1.0
    # float64: the same tokens at N=2 as at N=1, and as unpadded hf-generate.
    assert report["mismatches"] == []
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert "per configuration and concurrency" in out.stdout and "MISMATCH" not in out.stdout


def test_bench_configs_checks_one_configuration_against_target_only_in_pairs(
    tiny_target_dir: Path, tmp_path: Path
):
    """`--configs` with `--repeat 2` at `--concurrency 2`: only the configuration
    named and `outrider-k0` run; N = 1, not listed, runs one batch each, as the
    reference; N = 2 runs two, and the report pairs them."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "One two three, one two three, one two"}) + "\n")
    out = subprocess.run(
        [
            sys.executable, "-m", "outrider", "bench",
            "--prompts", str(prompts), "--target-model", str(tiny_target_dir), "--dtype", "float64",
            "--max-new-tokens", "8", "--drafters", "prompt-lookup", "--no-hf", "--threads", "1",
            "--concurrency", "2", "--configs", "outrider-*-adaptive", "--repeat", "2",
            "--ignore-eos", "--device", "cpu", "--json", str(tmp_path / "bench.json"),
            "--no-progress",
        ],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]

    report = json.loads((tmp_path / "bench.json").read_text())
    assert [c["name"] for c in report["configs"]] == [
        "outrider-k0",
        "outrider-prompt-lookup-adaptive",
    ]
    for config in report["configs"]:
        one, two = config["runs"]
        assert (one["concurrency"], two["concurrency"]) == (1, 2)
        assert "tokens_per_s_repeats" not in one and len(two["tokens_per_s_repeats"]) == 2
    assert report["configs"][1]["runs"][1]["vs_target_only_paired"] > 0
    assert report["mismatches"] == []
