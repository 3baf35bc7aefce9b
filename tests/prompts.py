"""Prompts the real-model tests send: shipped MT-Bench questions as chat token ids."""

from __future__ import annotations

from outrider.bench.prompts import PROMPT_SETS, load_prompts


def mt_bench_chat_ids(tokenizer, count: int) -> list[list[int]]:
    """The first ``count`` of every tenth MT-Bench question, each as one user
    message under ``tokenizer``'s chat template, ready for generation."""
    questions = load_prompts(PROMPT_SETS["mt-bench"])[::10][:count]
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question.text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for question in questions
    ]
