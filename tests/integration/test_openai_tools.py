"""Tool calls through the official ``openai`` client against a stack of
tiny models (random weights, a ChatML template that ignores tools, so the
prompt takes the Hermes path).

What each test proves, honestly: a random model never calls a tool by
itself, so the calls here come from a constraint — ``tool_choice``'s own
grammar ("required", a named function), or, for ``"auto"``, a grammar sent
in ``guided_grammar`` that makes the output a Hermes block, which the auto
path then parses like any model's. That the parser reads what real models
write is tests/unit/test_tool_calls.py's job."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

from outrider.coordinator.openai.tool_calls import call_grammar
from tests.integration.harness import running_stack
from tests.tiny import EOS_TOKEN_ID, build_tiny_model_dir

CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
GREEDY = dict(temperature=0, max_tokens=200)


@pytest.fixture(scope="module")
def long_models(tmp_path_factory, tiny_tokenizer_dir) -> tuple[Path, Path]:
    """The tiny target and an unrelated draft with a context of 2048: the
    tools block takes some 400 of the tiny tokenizer's tokens."""
    return tuple(  # type: ignore[return-value]
        build_tiny_model_dir(
            tmp_path_factory.mktemp(name), tiny_tokenizer_dir, seed=seed,
            max_position_embeddings=2048,
        )
        for name, seed in (("long-target", 0), ("long-draft", 1))
    )  # fmt: skip


@pytest.fixture
def stack(long_models):
    target, draft = long_models
    return running_stack(target, draft_dir=draft, eos_token_ids={EOS_TOKEN_ID}, http=True)


def api(stack) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="unused")


def checked_calls(choice) -> list[tuple[str, dict]]:
    """The choice's calls, each checked against its function's schema."""
    assert choice.finish_reason == "tool_calls", choice
    calls = []
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


async def streamed_calls(stream) -> tuple[str, list[tuple[str, dict]], str | None]:
    """A stream's content, its calls (each sent whole in one delta) and its finish reason."""
    content, calls, finish = "", [], None
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                assert call.index == len(calls) and call.id.startswith("call_")
                calls.append((call.function.name, json.loads(call.function.arguments)))
            finish = choice.finish_reason or finish
    return content, calls, finish


async def test_a_named_function_is_called_with_arguments_that_follow_its_schema(stack):
    """tool_choice naming a function: its grammar makes the call; the
    arguments validate, and streamed and not the calls are the same."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with stack as s, api(s) as client:
        chat = await client.chat.completions.create(
            model=None, messages=CHAT, tools=TOOLS, tool_choice=named, **GREEDY
        )
        (choice,) = chat.choices
        calls = checked_calls(choice)
        assert [name for name, _ in calls] == ["get_weather"]
        assert choice.message.content is None
        stream = await client.chat.completions.create(
            model=None, messages=CHAT, tools=TOOLS, tool_choice=named, stream=True, **GREEDY
        )
        assert await streamed_calls(stream) == ("", calls, "tool_calls")


async def test_required_calls_one_or_more_of_the_tools(stack):
    """tool_choice "required" with two tools: every call is one of them,
    with arguments that follow that tool's schema; streamed and not, the
    same calls. parallel_tool_calls false allows one call only."""
    async with stack as s, api(s) as client:
        for seed in range(3):
            options = dict(tools=TOOLS, tool_choice="required", temperature=1, seed=seed)
            chat = await client.chat.completions.create(
                model=None, messages=CHAT, max_tokens=200, **options
            )
            calls = checked_calls(chat.choices[0])
            assert calls and {name for name, _ in calls} <= set(SCHEMAS)
            stream = await client.chat.completions.create(
                model=None, messages=CHAT, max_tokens=200, stream=True, **options
            )
            assert await streamed_calls(stream) == ("", calls, "tool_calls")
            one = await client.chat.completions.create(
                model=None, messages=CHAT, max_tokens=200, parallel_tool_calls=False, **options
            )
            assert len(checked_calls(one.choices[0])) == 1


async def test_auto_parses_a_hermes_call_in_the_output(stack):
    """tool_choice "auto" adds no constraint; guided_grammar (the same
    grammar "required" would use) makes the tiny model write a Hermes
    block, which the auto path parses into tool_calls as it would a
    model's own — streamed and not."""
    grammar = call_grammar([("get_time", TIME)], many=False)
    options = dict(tools=TOOLS, tool_choice="auto", extra_body={"guided_grammar": grammar})
    async with stack as s, api(s) as client:
        chat = await client.chat.completions.create(model=None, messages=CHAT, **options, **GREEDY)
        calls = checked_calls(chat.choices[0])
        assert [name for name, _ in calls] == ["get_time"]
        stream = await client.chat.completions.create(
            model=None, messages=CHAT, stream=True, **options, **GREEDY
        )
        assert await streamed_calls(stream) == ("", calls, "tool_calls")
        # Without tools the same output is plain content.
        plain = await client.chat.completions.create(
            model=None, messages=CHAT, extra_body={"guided_grammar": grammar}, **GREEDY
        )
        assert plain.choices[0].message.tool_calls is None
        assert plain.choices[0].message.content.startswith("<tool_call>\n")


async def test_a_conversation_with_a_call_and_its_result_is_answered(stack):
    """An assistant message that called a tool (content null) and the
    tool's result go back through the template (the rendered text is
    tests/unit/test_tool_calls.py's)."""
    conversation = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    async with stack as s, api(s) as client:
        chat = await client.chat.completions.create(
            model=None, messages=conversation, tools=TOOLS, max_tokens=8, temperature=0
        )
        assert chat.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert chat.usage.prompt_tokens > 60  # the tools block and the call were rendered
        # A client may send the answer's message object back as it came.
        called = await client.chat.completions.create(
            model=None, messages=CHAT, tools=TOOLS, tool_choice="required", **GREEDY
        )
        message = called.choices[0].message
        result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C"}
        again = await client.chat.completions.create(
            model=None, messages=[*CHAT, message, result], tools=TOOLS, max_tokens=8
        )
        assert again.usage.prompt_tokens > called.usage.prompt_tokens


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"description": "x"}}]),
         "tools[0].function.name"),
        (dict(tools=[TOOLS[0], TOOLS[0]]), "tools[1].function.name"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
         "response_format"),
        (dict(tools=TOOLS, tool_choice="any"), "tool_choice"),
        (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
        (dict(messages=[{"role": "user"}]), "messages[0].content"),
    ],
)  # fmt: skip
async def test_wrong_tools_are_refused_naming_the_field(stack, options, param):
    options = {"messages": CHAT, **options}
    async with stack as s, api(s) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=None, **GREEDY, **options)  # type: ignore[arg-type]
    assert refused.value.body["param"] == param, refused.value.body
