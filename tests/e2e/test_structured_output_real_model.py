"""Structured output on the real default model, through the official
``openai`` client against `outrider up`: for the 20 prompts of the
``describe`` set, the answer under its JSON schema parses and validates,
and the greedy text is the same target-only (K = 0), with the default
drafter (on the CPU, the gguf drafter, masking its drafts with the
grammar) and adaptive K, and with prompt lookup."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

from outrider import model_specs
from outrider.bench.prompts import DESCRIBE_SCHEMA, PROMPT_SETS, load_prompts
from tests.e2e.stack import outrider_up

pytestmark = pytest.mark.e2e

MAX_TOKENS = 160
SCHEMA = json.loads(DESCRIBE_SCHEMA.read_text())
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "describe", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    if not model_specs.is_fetched(model_specs.DEFAULT_MODEL):
        pytest.skip("the default model is not fetched: run `outrider models fetch`")
    return [p.text for p in load_prompts(PROMPT_SETS["describe"])]


def answers(api_url: str, prompts: list[str], **extra) -> list[tuple[str, str | None]]:
    """Each prompt's greedy answer under the schema, and its finish reason."""
    with OpenAI(base_url=api_url, api_key="unused") as client:
        replies = [
            client.chat.completions.create(
                model=None,  # type: ignore[arg-type]
                messages=[{"role": "user", "content": prompt}],
                temperature=0,
                max_tokens=MAX_TOKENS,
                response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
                extra_body=extra,
            )
            for prompt in prompts
        ]
    return [(r.choices[0].message.content or "", r.choices[0].finish_reason) for r in replies]


def test_json_schema_answers_validate_and_agree_across_drafters(prompts):
    with outrider_up() as (_, api_url):
        target_only = answers(api_url, prompts, num_speculative_tokens=0)
        drafted = answers(api_url, prompts, adaptive=True)
    with outrider_up("--drafter", "prompt-lookup") as (_, api_url):
        lookup = answers(api_url, prompts, num_speculative_tokens=4)
    for prompt, want, got, got_lookup in zip(prompts, target_only, drafted, lookup, strict=True):
        assert got == want and got_lookup == want, prompt
        text, finish_reason = want
        assert finish_reason == "stop", (prompt, text)
        jsonschema.validate(json.loads(text), SCHEMA)
