"""The prompt set: JSONL rows, each sent as one user chat message."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path


def default_prompt_files() -> list[Path]:
    """MT-Bench from the shared data next to the repository, if it is there."""
    mt_bench = (
        Path(__file__).resolve().parents[3] / "shared" / "data" / "mt_bench" / "question.jsonl"
    )
    return [mt_bench] if mt_bench.is_file() else []


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    """Sent as one user message, rendered with the target's chat template."""


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
        ident = row.get("question_id", row.get("task_id", number))
        prompts.append(
            Prompt(
                id=f"{path.stem}:{ident}", category=str(row.get("category") or fallback), text=text
            )
        )
    return prompts
