"""Replays the coordinator's lookup drafters over the target's own greedy
answers: how many tokens a round of each would commit on fresh requests,
and why (rounds with no draft, drafts cut short, drafts rejected).

    python scripts/lookup_replay.py --prompts mt-bench --prompts humaneval --limit 16

The target (the default model, float32) answers each prompt greedily once;
then each drafter replays the synchronous round loop at a fixed K over that
answer: a round drafts up to K tokens after the committed history, the
target accepts the longest prefix that agrees with its answer, and commits
it plus one token. Greedy acceptance is agreement, so the replay commits
exactly what the services would, with no model in the loop. Every request
is fresh: suffix decoding's cache of earlier outputs starts empty for each.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from outrider.drafters.lookup import PromptLookup
from outrider.drafters.suffix import Limits, SuffixDecoding

DRAFTERS: dict[str, Callable[[], object]] = {
    "prompt-lookup (n 3..1)": lambda: PromptLookup(max_ngram=3, min_ngram=1),
    "prompt-lookup (n = 3)": lambda: PromptLookup(max_ngram=3, min_ngram=3),
    "suffix (factor 1)": lambda: SuffixDecoding(limits=Limits(max_spec_factor=1.0)),
    "suffix (factor 4)": lambda: SuffixDecoding(limits=Limits(max_spec_factor=4.0)),
    "suffix (factor 1, offset 4)": lambda: SuffixDecoding(
        limits=Limits(max_spec_factor=1.0, max_spec_offset=4.0)
    ),
}


@dataclass
class Tally:
    rounds: int = 0
    drafted: int = 0
    """Rounds that had a draft."""
    draft_tokens: int = 0
    accepted: int = 0
    short: int = 0
    """Drafted rounds whose draft was shorter than K while all of it was accepted."""

    def row(self, name: str) -> str:
        committed = self.rounds + self.accepted
        return (
            f"| {name} | {committed / self.rounds:.2f} | {self.drafted / self.rounds:.0%} | "
            f"{self.draft_tokens / max(1, self.drafted):.1f} | "
            f"{self.accepted / max(1, self.draft_tokens):.0%} | "
            f"{self.short / max(1, self.drafted):.0%} |"
        )


def replay(drafter, prompt: Sequence[int], answer: Sequence[int], k: int, tally: Tally) -> None:
    """The synchronous rounds of one request at K = ``k``."""
    session = drafter.index(len(prompt))
    history = list(prompt) + [answer[0]]  # the first token is the target's prefill's
    while len(history) < len(prompt) + len(answer):
        done = len(history) - len(prompt)
        room = len(answer) - done
        draft = session.match(history, min(k, room - 1)).tokens if room > 1 else []
        accepted = 0
        while accepted < len(draft) and draft[accepted] == answer[done + accepted]:
            accepted += 1
        tally.rounds += 1
        tally.drafted += bool(draft)
        tally.draft_tokens += len(draft)
        tally.accepted += accepted
        tally.short += bool(draft) and accepted == len(draft) < min(k, room - 1)
        history.extend(answer[done : done + accepted + 1])
    session.ended(history)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", action="append", default=None, help="a shipped set or a file")
    parser.add_argument("--limit", type=int, default=16, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from outrider import model_specs
    from outrider.bench.prompts import chat_prompt_ids, load_prompts, prompt_file

    directory = model_specs.resolve(None)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompts = [
        p for s in args.prompts or ["mt-bench"] for p in load_prompts(prompt_file(s), args.limit)
    ]
    answers = []
    for prompt in prompts:
        ids = chat_prompt_ids(tokenizer, prompt)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False
            )
        answers.append((ids, out[0, len(ids) :].tolist()))
    print(
        f"{len(prompts)} prompts × up to {args.max_new_tokens} tokens, K = {args.k}, "
        "every request fresh\n"
    )
    print(
        "| drafter | tokens a round | rounds with a draft | draft length | accepted | "
        "short, all accepted |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, make in DRAFTERS.items():
        tally = Tally()
        for ids, answer in answers:
            replay(make(), ids, answer, args.k, tally)
        print(tally.row(name))


if __name__ == "__main__":
    main()
