"""What structured output adds to a round on the CPU: the target's masks
of the K + 1 positions it verifies (the matcher stepped over the drafts,
then rolled back) and their application to its ``[K + 1, V]`` logits, and
a draft step's mask and its application to one row; each the median and
99th percentile over the rounds of answers that follow the ``describe``
schema, tokenized with the default model's tokenizer.

    python scripts/grammar_cost.py [--k 4] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from outrider import model_specs
from outrider.bench.prompts import DESCRIBE_SCHEMA
from outrider.grammar import Grammars
from outrider.sampling import constrain
from outrider.sampling_params import StructuredOutput

ANSWERS = [
    {
        "name": "Cat",
        "category": "animal",
        "summary": "A small domesticated carnivore kept as a pet.",
        "facts": ["Cats sleep about 15 hours a day.", "They have retractable claws."],
    },
    {
        "name": "Paris",
        "category": "city",
        "summary": "The capital of France, on the Seine.",
        "facts": ["It has about two million inhabitants.", "The Eiffel Tower opened in 1889."],
    },
]


def percentiles(samples: list[float]) -> str:
    p50, p99 = np.percentile(np.array(samples) * 1e6, [50, 99])
    return f"p50 {p50:6.1f} µs   p99 {p99:6.1f} µs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="drafts per round")
    parser.add_argument("--repeats", type=int, default=20, help="passes over the answers")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = model_specs.load_tokenizer(None)
    vocab = 49152
    grammars = Grammars.of_checkpoint(None, vocab)
    output = StructuredOutput("json_schema", DESCRIBE_SCHEMA.read_text())
    logits = torch.randn(args.k + 1, vocab)
    rounds, steps = [], []
    for _ in range(args.repeats):
        for answer in ANSWERS:
            ids = tokenizer(json.dumps(answer), add_special_tokens=False)["input_ids"]
            matcher = grammars.matcher(output)
            for start in range(0, len(ids) - args.k, args.k):
                drafts = ids[start : start + args.k]
                began = time.perf_counter()
                masks, allowed = matcher.masks(drafts)
                constrain(logits, masks)
                rounds.append(time.perf_counter() - began)
                assert allowed == len(drafts)
                for token in drafts:
                    began = time.perf_counter()
                    constrain(logits[:1], matcher.mask()[None])
                    steps.append(time.perf_counter() - began)
                    matcher.extend([token])
    print(f"target, a round of K = {args.k} ({len(rounds)} rounds): {percentiles(rounds)}")
    print(f"draft, one step ({len(steps)} steps):            {percentiles(steps)}")


if __name__ == "__main__":
    main()
