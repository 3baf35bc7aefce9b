"""Structured output and log-probabilities through the official ``openai``
client against a stack of tiny models: response_format and vLLM's guided
fields constrain the output exactly as the gRPC API's structured output
does; logprobs are the gRPC API's, in OpenAI's shapes, streamed and not;
and wrong combinations get a 400 naming the field."""

from __future__ import annotations

import json
import math

import openai
import pytest
from openai import AsyncOpenAI

from outrider.client import AsyncClient, StructuredOutput
from tests.integration.harness import running_stack
from tests.tiny import EOS_TOKEN_ID

CHAT = [{"role": "user", "content": "The quick brown fox"}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "count": {"type": "integer"}},
    "required": ["name", "count"],
    "additionalProperties": False,
}
GREEDY = dict(temperature=0, max_tokens=40)


@pytest.fixture
def stack(tiny_target_dir, tiny_draft_other_dir):
    return running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={EOS_TOKEN_ID}, http=True
    )


def api(stack) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="unused")


async def test_response_format_and_guided_fields_constrain_as_grpc_does(stack):
    json_schema = StructuredOutput("json_schema", json.dumps(SCHEMA))
    cases = [
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            ),
            json_schema,
        ),
        (dict(extra_body={"guided_json": SCHEMA}), json_schema),
        (dict(extra_body={"structured_outputs": {"json": SCHEMA}}), json_schema),
        (dict(response_format={"type": "json_object"}), StructuredOutput("json_object")),
        (
            dict(extra_body={"guided_regex": "(fox|dog) [a-z]{3,9}"}),
            StructuredOutput("regex", "(fox|dog) [a-z]{3,9}"),
        ),
        (
            dict(extra_body={"guided_choice": ["brown", "lazy dog"]}),
            StructuredOutput("choice", json.dumps(["brown", "lazy dog"])),
        ),
    ]
    async with stack as s, AsyncClient(s.address) as grpc_client, api(s) as client:
        for options, output in cases:
            chat = await client.chat.completions.create(
                model=None,
                messages=CHAT,
                **GREEDY,
                **options,  # type: ignore[arg-type]
            )
            want = await grpc_client.generate(
                messages=CHAT, max_new_tokens=40, structured_output=output
            )
            assert chat.choices[0].message.content == want.text, options
        schema = await client.chat.completions.create(
            model=None,
            messages=CHAT,
            **GREEDY,
            extra_body={"guided_json": SCHEMA},  # type: ignore[arg-type]
        )
        if schema.choices[0].finish_reason == "stop":
            value = json.loads(schema.choices[0].message.content or "")
            assert set(value) == {"name", "count"}


async def test_chat_and_completion_logprobs_are_the_grpc_ones(stack):
    async with stack as s, AsyncClient(s.address) as grpc_client, api(s) as client:
        want = await grpc_client.generate(messages=CHAT, max_new_tokens=24, logprobs=3)
        chat = await client.chat.completions.create(
            model=None,
            messages=CHAT,
            temperature=0,
            max_tokens=24,
            logprobs=True,
            top_logprobs=3,  # type: ignore[arg-type]
        )
        content = chat.choices[0].logprobs.content
        assert len(content) == len(want.token_ids)
        for entry, lp in zip(content, want.logprobs, strict=True):
            assert entry.logprob == pytest.approx(lp.logprob)
            assert len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
            assert bytes(entry.bytes) == entry.token.encode()
        stream = await client.chat.completions.create(
            model=None,
            messages=CHAT,
            temperature=0,
            max_tokens=24,
            logprobs=True,
            stream=True,  # type: ignore[arg-type]
        )
        streamed = [
            entry.logprob
            async for chunk in stream
            for choice in chunk.choices
            if choice.logprobs
            for entry in choice.logprobs.content or []
        ]
        assert streamed == pytest.approx([lp.logprob for lp in want.logprobs])

        text = await client.completions.create(
            model=None,
            prompt="The quick brown fox",
            temperature=0,
            max_tokens=16,
            logprobs=2,  # type: ignore[arg-type]
        )
        logprobs = text.choices[0].logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 16
        assert all(len(top) >= 2 for top in logprobs.top_logprobs)
        assert logprobs.text_offset[0] == 0
        assert all(math.isfinite(v) and v <= 0 for v in logprobs.token_logprobs)

        plain = await client.chat.completions.create(model=None, messages=CHAT, **GREEDY)  # type: ignore[arg-type]
        assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(extra_body={"guided_json": SCHEMA, "guided_regex": "a"}), "guided_json"),
        (
            dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
            "response_format",
        ),
        (dict(extra_body={"guided_regex": "(("}), "guided_regex"),
        (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
        (dict(extra_body={"guided_decoding_backend": "outlines"}), "guided_decoding_backend"),
    ],
)
async def test_wrong_combinations_name_the_field(stack, options, param):
    async with stack as s, api(s) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=None, messages=CHAT, **GREEDY, **options)  # type: ignore[arg-type]
    assert refused.value.body["param"] == param, refused.value.body
