"""Builds the agentic prompt set (``outrider bench --prompts agentic``):
multi-turn coding sessions over the shipped HumanEval stubs, each turn
resending the previous turn's code with a requested change, as a coding
agent does.

For each of 8 HumanEval tasks, spread over the file: turn 1 asks for the
function completed; turns 2 to 4 each send the code of the turn before —
the default model's own greedy answer, made here with transformers — and
ask for one change (type hints, descriptive names, comments). Each turn is
one row, sent as one user message, in order: a task's turns follow each
other. Deterministic on a given machine (greedy decoding in float32).

    python scripts/build_agentic_prompts.py [--out outrider/bench/data/agentic/agentic.jsonl]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from outrider.bench.prompts import PROMPT_SETS, spread  # noqa: E402

TASKS = 8
MAX_NEW_TOKENS = 256
FIRST = (
    "Complete the following Python function. Reply with the whole function in one code "
    "block.\n\n```python\n{code}\n```"
)
CHANGES = [
    "Add type hints to the local variables where they help, and keep the behaviour.",
    "Rename the local variables to longer, descriptive names, and keep the behaviour.",
    "Add a short comment above each block of the body explaining it.",
]
LATER = (
    "Here is my Python function:\n\n```python\n{code}\n```\n\n{change} Reply with the whole "
    "function in one code block."
)


def code_of(answer: str) -> str:
    """The first fenced code block of an answer, else all of it."""
    fenced = re.search(r"```(?:python)?\n(.*?)```", answer, re.DOTALL)
    return (fenced.group(1) if fenced else answer).strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=REPO / "outrider/bench/data/agentic/agentic.jsonl"
    )
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from outrider.model_specs import load_tokenizer, resolve

    tokenizer = load_tokenizer(None)
    model = AutoModelForCausalLM.from_pretrained(resolve(None), dtype=torch.float32).eval()
    rows = [json.loads(line) for line in PROMPT_SETS["humaneval"].read_text().splitlines()]
    out = []
    for row in (rows[i] for i in spread(len(rows), TASKS)):
        code = row["prompt"].strip()
        for turn in range(1 + len(CHANGES)):
            text = (
                FIRST.format(code=code)
                if turn == 0
                else LATER.format(code=code, change=CHANGES[turn - 1])
            )
            out.append(
                {"id": f"{row['task_id']}/turn{turn + 1}", "category": "agentic", "prompt": text}
            )
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
            )
            ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
            with torch.no_grad():
                generated = model.generate(
                    ids,
                    max_new_tokens=MAX_NEW_TOKENS,
                    do_sample=False,
                    attention_mask=torch.ones_like(ids),
                )
            code = code_of(tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True))
            print(f"{out[-1]['id']}: {len(generated[0]) - ids.shape[1]} tokens", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
