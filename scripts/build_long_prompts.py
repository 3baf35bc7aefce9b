"""Builds the long-context prompt set (``outrider bench --prompts long-context``)
from the two shipped sets, so that it needs no data of its own:

* ``code-qa-1k``, ``code-qa-3k`` — retrieval-augmented QA: HumanEval's
  function stubs, concatenated to about 1k or 3k tokens of the default
  model's tokenizer, then a question about one of them;
* ``summary-1k``, ``summary-3k`` — summarization: MT-Bench's questions as
  a numbered list of that length, then a request to summarise it.

Two prompts of each kind, different items in each. Deterministic: the
same shipped files give the same set.

    python scripts/build_long_prompts.py [--out outrider/bench/data/long_context/long_context.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from outrider.bench.prompts import PROMPT_SETS  # noqa: E402
from outrider.model_specs import DEFAULT_MODEL, load_tokenizer, resolve  # noqa: E402

LENGTHS = {"1k": 1000, "3k": 3000}
PER_KIND = 2


def _rows(name: str) -> list[dict]:
    lines = PROMPT_SETS[name].read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _fill(items: list[str], start: int, tokens: int, count) -> tuple[list[str], int]:
    """Items from ``start`` (wrapping) until their text holds ``tokens`` tokens."""
    chosen: list[str] = []
    i = start
    while count("\n\n".join(chosen)) < tokens:
        chosen.append(items[i % len(items)])
        i += 1
    return chosen, i


def build(count) -> list[dict]:
    stubs = [row["prompt"].strip() for row in _rows("humaneval")]
    entries = [row["entry_point"] for row in _rows("humaneval")]
    questions = [row["turns"][0].strip() for row in _rows("mt-bench")]
    rows = []
    stub_at = question_at = 0
    for label, tokens in LENGTHS.items():
        for n in range(PER_KIND):
            chosen, end = _fill(stubs, stub_at, tokens, count)
            asked = entries[(stub_at + len(chosen) // 2) % len(entries)]
            stub_at = end
            rows.append(
                {
                    "id": f"code-qa-{label}-{n}",
                    "category": f"code-qa-{label}",
                    "prompt": "Here are some Python functions with their docstrings.\n\n"
                    + "\n\n".join(chosen)
                    + f"\n\nQuestion: what does `{asked}` do, and how would you implement it?",
                }
            )
            chosen, question_at = _fill(questions, question_at, tokens, count)
            listed = "\n".join(f"{i}. {q}" for i, q in enumerate(chosen, start=1))
            rows.append(
                {
                    "id": f"summary-{label}-{n}",
                    "category": f"summary-{label}",
                    "prompt": "Below is a list of requests users sent to an assistant.\n\n"
                    + listed
                    + "\n\nSummarise the list: which topics come up, and which requests are alike?",
                }
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    out_default = PROMPT_SETS["mt-bench"].parents[1] / "long_context" / "long_context.jsonl"
    parser.add_argument("--out", type=Path, default=out_default)
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve(DEFAULT_MODEL))

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    rows = build(count)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    for row in rows:
        print(f"{row['id']:16} {count(row['prompt']):5} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
