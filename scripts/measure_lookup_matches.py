"""How prompt lookup's drafts fare by the length of their match.

Generates each prompt's greedy answer with the target (Hugging Face
``generate``, EOS ignored), then at every position of every answer looks up
the draft the coordinator's prompt lookup would offer after the history
(``coordinator.lookup.PromptLookup``) and counts, by the n of its match, how
often its first token is the target's next token and how many of its
leading tokens are; and, depth by depth, S(j) — how often its first j
tokens all are, among drafts of j tokens or more — against α^j of the
per-token rate α that one rate for all depths would take (accepted
drafts over those judged: the accepted ones and the first rejected).
Prints a Markdown table (docs/benchmark.md#prompt-lookup-by-match)::

    .venv/bin/python scripts/measure_lookup_matches.py --prompts mt-bench --limit 8
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM

from coordinator.lookup import PromptLookup
from outrider import models
from outrider.bench.prompts import load_prompts, prompt_file


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--prompts", default="mt-bench", help="a shipped prompt set or a JSONL file"
    )
    parser.add_argument("--limit", type=int, default=8, help="prompts, spread over the set")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--k", type=int, default=8, help="draft tokens looked up per position")
    parser.add_argument("--max-ngram", type=int, default=3, help="longest n-gram matched")
    args = parser.parse_args()

    tokenizer = models.load_tokenizer(None)
    model = AutoModelForCausalLM.from_pretrained(models.checkpoint_dir(None)).eval()
    lookup = PromptLookup(max_ngram=args.max_ngram)
    # By n: positions, first draft accepted, accepted drafts (leading, of up to k);
    # and by depth j, the drafts judged there (offered, every one before it
    # accepted) and accepted there.
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    judged: dict[int, list[int]] = defaultdict(lambda: [0] * args.k)
    accepted_at: dict[int, list[int]] = defaultdict(lambda: [0] * args.k)
    for prompt in load_prompts(prompt_file(args.prompts), args.limit):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=args.max_new_tokens,
                min_new_tokens=args.max_new_tokens,
                do_sample=False,
            )
        history = out[0].tolist()
        index = lookup.index()  # (as a session's, grown a token at a time)
        for position in range(len(ids), len(history)):
            match = index.match(history[:position], args.k)
            truth = history[position : position + args.k]
            drafts = match.tokens[: len(truth)]
            accepted = next(
                (i for i, (d, t) in enumerate(zip(drafts, truth, strict=False)) if d != t),
                len(drafts),
            )
            row = counts[match.n]
            row[0] += 1
            row[1] += accepted >= 1
            row[2] += accepted
            for j in range(min(accepted + 1, len(drafts))):
                judged[match.n][j] += 1
                accepted_at[match.n][j] += j < accepted
    depths = [j for j in (2, 4, 8) if j <= args.k]
    total = sum(row[0] for row in counts.values())
    columns = ["match", "positions", "first draft accepted, S(1)", "accepted drafts a position"]
    columns += [f"S({j})" for j in depths] + ["α"] + [f"α^{j}" for j in depths]
    print("| " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * (len(columns) - 1))
    for n in sorted(counts):
        positions, first, accepted = counts[n]
        cells = [f"{n}-gram" if n else "none", f"{positions} ({positions / total:.0%})"]
        if not n:
            print("| " + " | ".join(cells + ["–"] * (len(columns) - 2)) + " |")
            continue
        cells += [f"{first / positions:.2f}", f"{accepted / positions:.2f}"]
        survival, at = [], 1.0
        for j in range(args.k):
            at *= accepted_at[n][j] / judged[n][j] if judged[n][j] else float("nan")
            survival.append(at)
        alpha = sum(accepted_at[n]) / sum(judged[n])
        cells += [f"{survival[j - 1]:.2f}" for j in depths] + [f"{alpha:.2f}"]
        cells += [f"{alpha**j:.2f}" for j in depths]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
