"""Single-stream tokens/s of two checkouts, request by request.

Each checkout's services (target, and a coordinator drafting by prompt
lookup — on a draft worker of its own in checkouts older than
``coordinator/lookup.py``) run as processes, both stacks at once, with one
request in flight at a time: for every prompt and K the two checkouts run
it back to back, in alternating order, so drift in the machine's speed falls
on both alike. Prints tokens/s per checkout and K, their ratio, and whether
the outputs are identical::

    git worktree add /tmp/before <commit>
    python scripts/compare_checkouts.py --old /tmp/before --new . --ks 0,4
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MT_BENCH = Path(__file__).resolve().parents[1] / "outrider/bench/data/mt_bench/question.jsonl"


def start(
    checkout: Path, service: str, args: list[str], workdir: Path
) -> tuple[subprocess.Popen, str]:
    ready = workdir / f"{service}.port"
    process = subprocess.Popen(
        [sys.executable, "-m", "outrider", "serve", service, "--port", "0",
         "--ready-file", str(ready), "--log-level", "warning", *args],
        cwd=checkout, env=dict(os.environ, PYTHONPATH=str(checkout)), start_new_session=True,
    )  # fmt: skip
    while not ready.exists():
        if process.poll() is not None:
            raise SystemExit(f"{checkout}: the {service} exited with {process.returncode}")
        time.sleep(0.2)
    return process, f"127.0.0.1:{int(ready.read_text())}"


def start_stack(checkout: Path, processes: list[subprocess.Popen], workdir: Path) -> str:
    workdir.mkdir()
    target, target_address = start(checkout, "target", [], workdir)
    processes.append(target)
    drafting = ["--prompt-lookup"]
    if not (checkout / "coordinator" / "lookup.py").exists():
        draft, draft_address = start(checkout, "draft", ["--drafter", "prompt-lookup"], workdir)
        processes.append(draft)
        drafting = ["--draft", draft_address]
    coordinator, address = start(
        checkout, "coordinator", ["--target", target_address, *drafting], workdir
    )
    processes.append(coordinator)
    return address


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--old", type=Path, required=True, help="the checkout to compare against")
    parser.add_argument("--new", type=Path, required=True, help="the checkout under test")
    parser.add_argument(
        "--prompts", type=Path, default=MT_BENCH, help="MT-Bench-style JSONL (turns[0] is asked)"
    )
    parser.add_argument("--limit", type=int, default=8, help="prompts, spread evenly over the file")
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens per request (EOS ignored)"
    )
    parser.add_argument(
        "--ks", default="0,4", help="draft tokens per round to compare, comma-separated"
    )
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()

    sys.path.insert(0, str(args.new))
    from outrider.client import Client

    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [rows[i * len(rows) // args.limit]["turns"][0] for i in range(args.limit)]
    ks = [int(k) for k in args.ks.split(",")]
    processes: list[subprocess.Popen] = []
    workdir = tempfile.TemporaryDirectory(prefix="compare-checkouts-")
    try:
        clients = {
            name: Client(
                start_stack(path.resolve(), processes, Path(workdir.name) / name), timeout=600
            )
            for name, path in (("old", args.old), ("new", args.new))
        }

        def generate(name: str, prompt: str, k: int, tokens: int) -> list[int]:
            messages = [{"role": "user", "content": prompt}]
            reply = clients[name].generate(
                messages=messages, max_new_tokens=tokens, num_speculative_tokens=k, ignore_eos=True
            )
            return list(reply.token_ids)

        for name in clients:  # warm-up
            for k in ks:
                generate(name, "Hi", k, 8)
        totals = {(name, k): [0, 0.0] for name in clients for k in ks}
        identical = True
        for i, prompt in enumerate(prompts):
            for k in ks:
                outputs = {}
                for name in ("old", "new") if (i + k) % 2 == 0 else ("new", "old"):
                    started = time.perf_counter()
                    outputs[name] = generate(name, prompt, k, args.max_new_tokens)
                    totals[name, k][0] += len(outputs[name])
                    totals[name, k][1] += time.perf_counter() - started
                identical &= outputs["old"] == outputs["new"]
                rates = " ".join(
                    f"{name} {totals[name, k][0] / totals[name, k][1]:.2f}" for name in clients
                )
                print(
                    f"prompt {i + 1}/{len(prompts)} K={k}: tok/s so far {rates}",
                    file=sys.stderr,
                    flush=True,
                )
        summary: dict[str, object] = {
            f"{name}-k{k}": round(n / s, 3) for (name, k), (n, s) in totals.items()
        }
        for k in ks:
            summary[f"new/old-k{k}"] = round(summary[f"new-k{k}"] / summary[f"old-k{k}"], 3)
        summary["identical_outputs"] = identical
        print(json.dumps(summary, indent=2))
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2) + "\n")
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for process in processes:
            process.wait()
        workdir.cleanup()


if __name__ == "__main__":
    main()
