"""Tool calls without a server: the Hermes parser on hand-written outputs
(whole and streamed in pieces of every size), the grammar that
"required" and a named function compile into (llguidance, the tiny
tokenizer), the chat template's two paths, and the request's checks."""

import json

import pytest
from transformers import AutoTokenizer

from outrider import errors
from outrider.coordinator.chat_template import ChatMessage, ToolCall, render, uses_tools
from outrider.coordinator.openai.schemas import ChatCompletionRequest
from outrider.coordinator.openai.tool_calls import (
    ToolCallParser,
    call_grammar,
    finish_reason,
    parse,
)
from outrider.coordinator.requests import (
    FieldNames,
    RequestBuilder,
    RequestParams,
    SpeculationDefaults,
)
from outrider.coordinator.served_models import Models
from outrider.coordinator.workers.protocol import WorkerInfo
from outrider.grammar import Grammars
from outrider.sampling_params import StructuredOutput
from tests.tiny import EOS_TOKEN_ID

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
OUTPUTS = [
    CALL,
    f"{CALL}\n{CALL_2}",
    f"Let me look.\n{CALL}\nDone.",
    "No call < here, <tool but <tool_call is not closed",
    "<tool_call>\n{not json}\n</tool_call> and text",
    f"<tool_call>\n[1, 2]\n</tool_call>\n{CALL}  ",
    "plain text with trailing blanks  \n",
]


def test_a_hermes_call_becomes_a_tool_call_and_the_text_around_it_content():
    content, calls = parse(f"Let me look.\n{CALL}\n{CALL_2}\n")
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("ping", {}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize(
    "block",
    [
        "{not json}",
        '{"arguments": {}}',  # no name
        '{"name": "f", "arguments": "x"}',  # arguments not an object
        "[1, 2]",
    ],
)
def test_a_block_that_is_not_a_call_stays_content(block):
    text = f"<tool_call>\n{block}\n</tool_call>"
    assert parse(text) == (text, [])


def test_a_block_left_open_stays_content():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {'
    assert parse(text) == (text, [])


@pytest.mark.parametrize("output", OUTPUTS)
def test_streamed_pieces_add_up_to_the_whole_parse(output):
    whole, calls = parse(output)
    for size in range(1, len(output) + 1):
        parser = ToolCallParser()
        pieces = [output[i : i + size] for i in range(0, len(output), size)]
        fed = [parser.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(content for content, _ in fed) == whole, size
        streamed = [(c.name, c.arguments) for _, new in fed for c in new]
        assert streamed == [(c.name, c.arguments) for c in calls], size


def test_a_possible_start_of_a_call_is_held_back_until_it_is_not_one():
    parser = ToolCallParser()
    assert parser.feed("Hello <tool") == ("Hello", [])
    assert parser.feed("kit") == (" <toolkit", [])
    assert parser.feed(" <tool_call>\n{") == ("", [])
    content, calls = parser.feed('"name": "f", "arguments": {}}\n</tool_call>')
    assert content == "" and [c.name for c in calls] == ["f"]


def test_the_finish_reason_is_tool_calls_only_when_an_output_that_called_stopped():
    assert finish_reason("stop", called=True) == "tool_calls"
    assert finish_reason("length", called=True) == "length"
    assert finish_reason("stop", called=False) == "stop"
    assert finish_reason(None, called=True) is None


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def allows(grammars: Grammars, output: StructuredOutput, tokenizer, text: str) -> bool:
    matcher = grammars.matcher(output)
    return all(matcher.consume(t) for t in tokenizer(text)["input_ids"])


def test_the_call_grammar_admits_calls_that_follow_the_schemas_only(tokenizer):
    grammars = Grammars.of_tokenizer(tokenizer, len(tokenizer), [EOS_TOKEN_ID])
    functions = [("get_weather", WEATHER), ("ping", None)]
    many = StructuredOutput("grammar", call_grammar(functions, many=True))
    one = StructuredOutput("grammar", call_grammar(functions[:1], many=False))
    grammars.check(many)
    assert allows(grammars, many, tokenizer, f"{CALL}\n{CALL_2}")
    assert allows(grammars, one, tokenizer, CALL)
    assert not allows(grammars, one, tokenizer, f"{CALL}\n<")  # one call only
    for wrong in (
        CALL.replace("Paris", "Rome"),  # outside the enum
        CALL.replace("get_weather", "get_time"),  # not a tool
        CALL_2.replace("{}", '{"x": 1}'),  # ping takes no arguments
        CALL.replace('{"name"', '{ "name"'),  # laid out as json.dumps does
        "Sure. " + CALL,  # nothing before the call
    ):
        assert not allows(grammars, many, tokenizer, wrong), wrong
    # A finished call allows only the end of the sequence.
    matcher = grammars.matcher(one)
    matcher.extend(tokenizer(CALL)["input_ids"])
    assert matcher.consume(EOS_TOKEN_ID)


CONVERSATION = [
    ChatMessage("system", "Be brief."),
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
    ChatMessage("tool", "18 C", tool_call_id="call_1"),
    ChatMessage("tool", "sunny", tool_call_id="call_1"),
]


def test_a_template_that_ignores_tools_gets_them_hermes_style(tokenizer):
    """The tiny tokenizer's ChatML template, as SmolLM2's, ignores tools:
    the prompt lists them, writes the call and its results as Qwen2.5 does.
    RequestBuilder.prompt_ids renders them so."""
    assert not uses_tools(tokenizer)
    target = WorkerInfo(
        model="t", drafter="", vocab_size=len(tokenizer), vocab_fingerprint="", max_context=2048
    )
    builder = RequestBuilder(
        Models(tokenizer=tokenizer, eos_token_ids=frozenset({EOS_TOKEN_ID}), target=target),
        SpeculationDefaults(
            default_num_speculative_tokens=4,
            max_num_speculative_tokens=8,
            default_max_new_tokens=16,
        ),
        drafts=True,
    )
    params = RequestParams(messages=CONVERSATION, tools=TOOLS)
    prompt = tokenizer.decode(builder.prompt_ids(params, FieldNames()))
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(TOOLS[0])}\n</tools>" in prompt
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>" in prompt
    assert (
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n"
        "<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in prompt
    # Without tools (tool_choice "none"), calls and results are still written.
    bare = tokenizer.decode(render(tokenizer, CONVERSATION))
    assert "<tools>" not in bare and CALL in bare and "<tool_response>\n18 C" in bare


def test_a_template_that_renders_tools_gets_them_as_transformers_passes_them(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.city }}>"
        "{% endfor %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}"
    )
    assert uses_tools(tokenizer)
    prompt = tokenizer.decode(render(tokenizer, CONVERSATION, TOOLS))
    assert prompt == (
        "[get_weather]system:Be brief.;user:Weather in Paris?;"
        "assistant:<get_weather Paris>;tool:18 C#call_1;tool:sunny#call_1;"
    )


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hi"}], **body}
    )


def test_tool_choice_defaults_to_auto_with_tools_and_only_forcing_ones_constrain():
    assert chat().tool_mode == "none" and chat(tools=TOOLS).tool_mode == "auto"
    assert chat(tools=TOOLS, tool_choice="none").rendered_tools() == []
    assert chat(tools=TOOLS).rendered_tools() == TOOLS
    assert chat(tools=TOOLS).structured_output() == (None, "")
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        output, field = chat(tools=TOOLS, tool_choice=choice).structured_output()
        assert output is not None and output.kind == "grammar" and field == "tool_choice"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": "x", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
         "messages[0].tool_calls"),
        ({"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{x"}}]},
         "messages[0].tool_calls[0].function.arguments"),
        ({"role": "user", "content": "x", "tool_call_id": "1"}, "messages[0].tool_call_id"),
        ({"role": "assistant", "content": None}, "messages[0].content"),
    ],
)  # fmt: skip
def test_a_wrong_tool_message_is_refused_naming_its_field(message, param):
    with pytest.raises(errors.InvalidArgument) as info:
        ChatCompletionRequest.model_validate({"messages": [message]}).chat_messages()
    assert info.value.param == param
