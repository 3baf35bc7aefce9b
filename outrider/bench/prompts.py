"""The prompt set: JSONL rows, each sent as one user chat message.

Five sets ship with the package, each beside its licence and provenance
(``outrider/bench/data/``): the 80 MT-Bench questions (Apache-2.0), the
164 HumanEval prompts (MIT), 8 long-context prompts of about 1k and 3k
tokens built from those two by ``scripts/build_long_prompts.py``, 20
``describe`` requests for JSON, and 32 agentic turns — coding sessions over
HumanEval, each turn resending the last answer's code with a change
(``scripts/build_agentic_prompts.py``).
``--prompts`` names one of them or a file.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
PROMPT_SETS = {
    "mt-bench": DATA_DIR / "mt_bench" / "question.jsonl",
    "humaneval": DATA_DIR / "humaneval" / "HumanEval_prompts.jsonl",
    "long-context": DATA_DIR / "long_context" / "long_context.jsonl",
    "describe": DATA_DIR / "describe" / "describe.jsonl",
    "agentic": DATA_DIR / "agentic" / "agentic.jsonl",
}
"""The shipped prompt sets, by the name ``--prompts`` takes."""
DEFAULT_PROMPT_SET = "mt-bench"
DESCRIBE_SCHEMA = DATA_DIR / "describe" / "describe.schema.json"
"""The JSON schema the ``describe`` set's answers follow (``--json-schema``)."""


def prompt_file(name_or_path: str) -> Path:
    """The file of a shipped prompt set named ``name_or_path``, else that path."""
    return PROMPT_SETS.get(name_or_path, Path(name_or_path))


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    """Sent as one user message, rendered with the target's chat template."""

    @property
    def seed(self) -> int:
        """A sampled request's seed: the same for a prompt in every
        configuration and run, so that target-only and speculative decoding
        draw from the same distribution with the same seeds."""
        return zlib.crc32(self.id.encode())


def category_of_file(path: Path) -> str:
    """A category for a file's rows that carry none: its stem, lower-cased,
    without a ``_prompts``/``_questions`` suffix (``HumanEval_prompts`` → ``humaneval``)."""
    stem = path.stem.lower()
    return re.sub(r"[_\-.]?(prompts?|questions?)$", "", stem) or stem


def spread(n: int, limit: int | None) -> list[int]:
    """``limit`` indices out of ``n``, evenly spaced from the first (all when ``limit`` is None)."""
    if limit is None or limit >= n:
        return list(range(n))
    return [i * n // limit for i in range(limit)]


def load_prompts(path: Path, limit: int | None = None) -> list[Prompt]:
    """The prompts of one JSONL file; with ``limit``, that many rows spread evenly over it.

    A row's text is ``turns[0]`` or ``prompt``; its category the row's
    ``category``, else :func:`category_of_file`.
    """
    path = Path(path)
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
    fallback = category_of_file(path)
    prompts = []
    for number, row in (rows[i] for i in spread(len(rows), limit)):
        if isinstance(row.get("turns"), list) and row["turns"]:
            text = row["turns"][0]
        elif isinstance(row.get("prompt"), str):
            text = row["prompt"]
        else:
            raise ValueError(f"{path}:{number}: a row needs `turns` (a non-empty list) or `prompt`")
        ident = row.get("question_id", row.get("task_id", row.get("id", number)))
        prompts.append(
            Prompt(
                id=f"{path.stem}:{ident}", category=str(row.get("category") or fallback), text=text
            )
        )
    return prompts


def chat_prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """The prompt's token ids as one user chat message under the tokenizer's
    chat template, as the coordinator renders it."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt.text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    return list(encoded["input_ids"])
