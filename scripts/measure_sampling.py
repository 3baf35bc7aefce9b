"""Acceptance of rejection vs gumbel verification on the default target, with
a model draft (the target itself in bfloat16), and the bytes of q on the wire.

    .venv/bin/python scripts/measure_sampling.py --prompts 10 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from measure_drafters import prompts
from tqdm import tqdm

from outrider import Client
from outrider.stack import start_stack

DRAFT_ARGS = ["--drafter", "model", "--dtype", "bfloat16"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    questions = prompts(args.prompts)
    configs = [(t, mode) for t in args.temperatures for mode in ("rejection", "gumbel")]
    totals = {
        c: {"rounds": 0, "draft_tokens": 0, "accepted_tokens": 0, "bytes": 0, "tokens": 0}
        for c in configs
    }
    with start_stack(draft_args=DRAFT_ARGS) as stack, Client(stack.coordinator.address) as client:
        work = [(c, i, q) for i, q in enumerate(questions) for c in configs]  # interleaved
        for (temperature, mode), seed, question in tqdm(work, desc="sampling", unit="run"):
            stats = client.generate(
                messages=[{"role": "user", "content": question}],
                max_new_tokens=args.max_new_tokens,
                num_speculative_tokens=args.k,
                temperature=temperature,
                seed=seed,
                verification=mode,
            ).stats
            t = totals[(temperature, mode)]
            t["rounds"] += stats.rounds
            t["draft_tokens"] += stats.draft_tokens
            t["accepted_tokens"] += stats.accepted_tokens
            t["bytes"] += stats.draft_probs_bytes
            t["tokens"] += stats.generated_tokens
    rows = []
    for (temperature, mode), t in totals.items():
        rows.append(
            {
                "temperature": temperature,
                "verification": mode,
                "acceptance_rate": t["accepted_tokens"] / t["draft_tokens"],
                "mean_acceptance_length": (t["accepted_tokens"] + t["rounds"]) / t["rounds"],
                "q_bytes_per_round": t["bytes"] / t["rounds"],
                "rounds": t["rounds"],
                "generated_tokens": t["tokens"],
            }
        )
    print(
        f"\n{len(questions)} MT-Bench prompts x {args.max_new_tokens} tokens, "
        f"draft: the target in bfloat16, K={args.k}\n"
    )
    print(
        "| temperature | verification | acceptance rate | mean acceptance length "
        "| q bytes / round |"
    )
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['temperature']} | {r['verification']} | {r['acceptance_rate']:.3f} "
            f"| {r['mean_acceptance_length']:.2f} | {r['q_bytes_per_round']:.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
