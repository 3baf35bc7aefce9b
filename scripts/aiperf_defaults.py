"""Outrider's defaults against `--k 0`, measured by NVIDIA's aiperf the way a
new user measures a server: `outrider up --http-port` per configuration, then
aiperf's synthetic chat load at temperature 1 (the OpenAI default) and 0, at
each concurrency. Prints one Markdown table: output tokens/s and mean
inter-token latency per cell, and each configuration ÷ `--k 0`.

    pip install aiperf==0.13.0    # its own virtual environment is best: it is large
    python scripts/aiperf_defaults.py --aiperf /path/to/venv/bin/aiperf

Configurations run in the order given, then in reverse (--rounds 2), so that
a drift of the machine's speed falls on both sides of each ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "defaults": [],
    "--k 0": ["--k", "0"],
    "int4": ["--drafter", "int4"],
    "prompt lookup": ["--drafter", "prompt-lookup"],
    "int4 K=4": ["--drafter", "int4", "--k", "4"],
}


def start(flags: list[str], http_port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "outrider", "up", "--port", "0", "--http-port", str(http_port)]
        + flags,
        stdout=subprocess.PIPE,
        text=True,
    )
    for line in process.stdout:
        if "OpenAI-compatible API" in line:
            return process
    raise SystemExit(f"outrider up {' '.join(flags)} exited with {process.wait()}")


def profile(aiperf: str, model_dir: Path, port: int, temperature: float, n: int, out: Path) -> dict:
    command = [
        aiperf, "profile", "-m", "smollm2-135m-instruct", "--tokenizer", str(model_dir),
        "--endpoint-type", "chat", "--url", f"127.0.0.1:{port}", "--streaming",
        "--synthetic-input-tokens-mean", "128", "--output-tokens-mean", "48",
        "--request-count", str(max(8, 2 * n)), "--concurrency", str(n),
        "--warmup-request-count", str(n), "--extra-inputs", f"temperature:{temperature}",
        "--ui-type", "none", "--artifact-dir", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    result = json.loads((out / "profile_export_aiperf.json").read_text())
    return {
        "tok_s": result["output_token_throughput"]["avg"],
        "itl_ms": result["inter_token_latency"]["avg"],
        "errors": (result.get("error_request_count") or {}).get("avg", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf executable")
    parser.add_argument("--concurrency", default="1,2,8")
    parser.add_argument("--temperatures", default="1,0")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the configurations")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="of: " + ", ".join(CONFIGS))
    parser.add_argument("--http-port", type=int, default=8123)
    parser.add_argument("--json", type=Path, help="write every cell's runs here")
    args = parser.parse_args()
    from outrider import model_specs

    model_dir = model_specs.model_path(model_specs.DEFAULT_MODEL)
    names = args.configs.split(",")
    levels = [int(n) for n in args.concurrency.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    runs: dict[str, list[dict]] = {}
    work = Path(tempfile.mkdtemp(prefix="aiperf-defaults-"))
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            server = start(CONFIGS[name], args.http_port)
            try:
                for t in temperatures:
                    for n in levels:
                        cell = f"{name}|{t:g}|{n}"
                        out = work / re.sub(r"\W+", "-", f"{cell}-{round_}")
                        runs.setdefault(cell, []).append(
                            profile(args.aiperf, model_dir, args.http_port, t, n, out)
                        )
                        print(cell, runs[cell][-1], flush=True)
            finally:
                server.terminate()
                server.wait(60)
                time.sleep(2)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    print(table(runs, names, temperatures, levels))


def table(runs: dict[str, list[dict]], names, temperatures, levels) -> str:
    """Medians of each cell's runs; ratios to `--k 0` of the same cell."""

    def median(cell: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[cell])

    lines = [
        "| server | temperature | N | output tok/s | ÷ `--k 0` | ITL avg ms | ÷ `--k 0` | runs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        for t in temperatures:
            for n in levels:
                cell, base = f"{name}|{t:g}|{n}", f"--k 0|{t:g}|{n}"
                tok, itl = median(cell, "tok_s"), median(cell, "itl_ms")
                ratio = tok / median(base, "tok_s") if base in runs else float("nan")
                itl_ratio = itl / median(base, "itl_ms") if base in runs else float("nan")
                lines.append(
                    f"| {name} | {t:g} | {n} | {tok:.1f} | {ratio:.2f} | {itl:.0f} | "
                    f"{itl_ratio:.2f} | {len(runs[cell])} |"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
