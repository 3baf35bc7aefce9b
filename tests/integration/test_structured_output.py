"""Structured output through three real gRPC services on tiny float64
models: greedy output under a constraint is exactly constrained target-only
decoding — computed here independently, with Hugging Face's forward and
llguidance's own matcher — for every drafter, K and pipelining; the output
follows the constraint; and a constraint that does not compile is refused
before any worker sees it."""

from __future__ import annotations

import json
import re

import grpc
import llguidance
import numpy as np
import pytest
import torch
from llguidance.hf import from_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from outrider.client import AsyncClient, StructuredOutput
from outrider.grammar import grammar_text
from tests.integration.harness import running_stack

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
MAX_NEW = 40
EOS = 0  # the tiny tokenizer's first special token stands in for an end-of-sequence token

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "count": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["fox", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "count", "tags"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "regex": StructuredOutput("regex", r"(the|a) (quick|lazy) [a-z]{2,8}( [a-z]{1,6}){2,5}\."),
    "choice": StructuredOutput("choice", json.dumps(["brown fox", "lazy dog", "quick"])),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer(PROMPT)["input_ids"]


def constrained_greedy(model_dir, tokenizer, prompt_ids, output, eos) -> list[int]:
    """Target-only greedy decoding under ``output``: at each step the
    argmax of the logits among the tokens llguidance allows."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    vocab = model.config.vocab_size
    matcher = llguidance.LLMatcher(
        from_tokenizer(tokenizer, n_vocab=vocab, eos_token=sorted(eos)), grammar_text(output)
    )
    ids = list(prompt_ids)
    while len(ids) - len(prompt_ids) < MAX_NEW:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        logits[~torch.from_numpy(bits[:vocab].astype(bool))] = -torch.inf
        token = int(logits.argmax())
        ids.append(token)
        if token in eos:
            break
        assert matcher.consume_token(token)
    return ids[len(prompt_ids) :]


@pytest.fixture(scope="module")
def references(tiny_target_dir, tokenizer, prompt_ids):
    eos = {tokenizer.eos_token_id if tokenizer.eos_token_id is not None else EOS}
    return {
        name: constrained_greedy(tiny_target_dir, tokenizer, prompt_ids, output, eos)
        for name, output in CONSTRAINTS.items()
    }


def follows(output: StructuredOutput, text: str) -> bool:
    if output.kind == "json_schema":
        value = json.loads(text)
        return set(value) == {"name", "count", "tags"} and len(value["name"]) <= 10
    if output.kind == "regex":
        return re.fullmatch(output.spec, text) is not None
    return text in json.loads(output.spec)


STACKS = {
    "other": dict(draft="other"),
    "same": dict(draft="same"),
    "prompt-lookup": dict(drafter="prompt-lookup"),
    "int4": dict(drafter="int4"),
    "eagle": dict(drafter="eagle", head="head"),
}


@pytest.mark.parametrize("drafter", list(STACKS))
async def test_constrained_greedy_output_equals_constrained_target_only(
    request, tiny_target_dir, tokenizer, prompt_ids, references, drafter
):
    options = dict(STACKS[drafter])
    if "draft" in options:
        options["draft_dir"] = request.getfixturevalue(f"tiny_draft_{options.pop('draft')}_dir")
    if "head" in options:
        options["head_dir"] = request.getfixturevalue(f"tiny_{options.pop('head')}_dir")
    eos = {tokenizer.eos_token_id if tokenizer.eos_token_id is not None else EOS}
    draft_tokens = 0
    async with running_stack(tiny_target_dir, eos_token_ids=eos, **options) as stack:
        async with AsyncClient(stack.address) as client:
            for name, output in CONSTRAINTS.items():
                runs = [
                    await client.generate(
                        token_ids=prompt_ids,
                        max_new_tokens=MAX_NEW,
                        structured_output=output,
                        **kwargs,
                    )
                    for kwargs in (
                        dict(num_speculative_tokens=0),
                        dict(num_speculative_tokens=4),
                        dict(num_speculative_tokens=4, pipeline=True),
                    )
                ]
                for run in runs:
                    assert list(run.token_ids) == references[name], (name, run.stats)
                drafted = runs[1]
                draft_tokens += drafted.stats.draft_tokens
                if drafted.finish_reason == "stop":
                    assert follows(output, drafted.text), drafted.text
    assert draft_tokens > 0


async def test_a_constraint_that_does_not_compile_is_refused(tiny_target_dir, prompt_ids):
    async with running_stack(tiny_target_dir, drafter=None) as stack:
        async with AsyncClient(stack.address) as client:
            for output, message in [
                (StructuredOutput("regex", "(("), "regex does not compile"),
                (StructuredOutput("json_schema", "{"), "json_schema: the JSON schema is not JSON"),
                (StructuredOutput("choice", "[]"), "a choice constraint is a non-empty list"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.generate(token_ids=prompt_ids, structured_output=output)
                assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert message in (refused.value.details() or "")
