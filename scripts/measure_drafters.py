"""Measures the drafter candidates for the default target (the README table).

For each candidate it starts the three services (as `outrider up` does) and
runs each MT-Bench prompt twice, interleaved so that machine noise hits both
alike: once with K = 0 (target only, the same path) and once with
speculation. It checks both outputs are identical and prints a Markdown
table of tokens/s, mean acceptance length and speedup vs K = 0.

    .venv/bin/python scripts/measure_drafters.py --prompts 10 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from outrider import Client
from outrider.bench.prompts import PROMPT_SETS
from outrider.stack import start_stack

MT_BENCH = PROMPT_SETS["mt-bench"]

CANDIDATES = {
    "prompt lookup": None,  # (in the coordinator: no draft worker)
    "target in 4 bits (int4)": ["--drafter", "int4"],
    "target in bfloat16": ["--drafter", "model", "--dtype", "bfloat16"],
    "early exit, 8 of 30 layers": ["--drafter", "early-exit", "--draft-layers", "8"],
}


def prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    return [row["turns"][0] for row in rows[:n]]


def measure(
    name: str, draft_args: list[str] | None, questions: list[str], k: int, max_new_tokens: int
) -> dict:
    totals = {0: [0, 0.0], k: [0, 0.0]}
    rounds = accepted = 0
    coordinator = ["--log-level", "warning", *(["--prompt-lookup"] if draft_args is None else [])]
    with start_stack(
        draft_args=draft_args or (), coordinator_args=coordinator, with_draft=draft_args is not None
    ) as stack:
        with Client(stack.coordinator.address) as client:
            for question in tqdm(questions, desc=name, unit="prompt"):
                outputs = {}
                for kk in (0, k):
                    result = client.generate(
                        messages=[{"role": "user", "content": question}],
                        max_new_tokens=max_new_tokens,
                        num_speculative_tokens=kk,
                    )
                    outputs[kk] = result.token_ids
                    totals[kk][0] += result.stats.generated_tokens
                    totals[kk][1] += result.stats.total_time_s
                    if kk:
                        rounds += result.stats.rounds
                        accepted += result.stats.accepted_tokens
                if outputs[0] != outputs[k]:
                    raise SystemExit(f"{name}: speculative output differs from K=0 on {question!r}")
    tps = {kk: tokens / seconds for kk, (tokens, seconds) in totals.items()}
    return {
        "drafter": name,
        "k": k,
        "tokens_per_s": tps[k],
        "baseline_tokens_per_s": tps[0],
        "mean_acceptance_length": (accepted + rounds) / rounds,
        "speedup": tps[k] / tps[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--only", action="append", help="measure only these candidates")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    questions = prompts(args.prompts)
    rows = [
        measure(name, draft_args, questions, args.k, args.max_new_tokens)
        for name, draft_args in CANDIDATES.items()
        if not args.only or name in args.only
    ]
    print(
        f"\n{len(questions)} MT-Bench prompts x {args.max_new_tokens} new tokens, greedy, "
        f"K={args.k}\n"
    )
    print("| drafter | tokens/s | K=0 tokens/s | mean acceptance length | speedup vs K=0 |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['drafter']} | {r['tokens_per_s']:.2f} | {r['baseline_tokens_per_s']:.2f} "
            f"| {r['mean_acceptance_length']:.2f} | {r['speedup']:.2f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
