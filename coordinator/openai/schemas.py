"""The request bodies of OpenAI's chat completions and completions APIs, as
pydantic models: the types are checked strictly (a string is not a number),
and a field OpenAI's API does not have is refused, as OpenAI refuses it.

Fields of OpenAI's API that Outrider does not implement are accepted only
at the value that leaves the output unchanged (``frequency_penalty: 0``,
``echo: false``, ...), else refused with a message naming the field.
vLLM's extra fields that its clients send (``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids``, ``min_tokens``,
``include_stop_str_in_output``, ``skip_special_tokens``, the guided-decoding
fields, ...) are accepted with vLLM's meaning, or refused the same way
(``repetition_penalty`` but 1); Outrider's own (``num_speculative_tokens``,
``adaptive``, ``verification``, ``pipeline``) are extra fields too. Any other
field is refused as OpenAI refuses it (docs/openai-api.md lists them all).
``response_format`` and the guided-decoding fields become the request's
structured output (one of them at most).

Tools are checked here too (``tools``, ``tool_choice``, the messages'
``tool_calls`` and ``tool_call_id``): ``tool_choice`` ``"required"`` or a
named function is a structured output like ``response_format``, a grammar
of the calls (``outrider.coordinator.openai.tool_calls``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from outrider.coordinator.chat_template import ChatMessage, ToolCall
from outrider.errors import InvalidArgument
from outrider.sampling_params import MAX_LOGPROBS, StructuredOutput

from .tool_calls import call_grammar


def one_of(description: str) -> WrapValidator:
    """Replaces the per-alternative errors of a union by one message."""

    def validate(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", f"must be {description}") from None

    return WrapValidator(validate)


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: str
    """JSON text."""


class MessageToolCall(Body):
    """A call an assistant message made."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(Body):
    role: str
    content: Annotated[
        str | list[TextPart] | None,
        one_of("a string or a list of text parts ({type: text, text})"),
    ] = None
    """None only in an assistant message that calls tools."""
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    """An assistant message's calls."""
    tool_call_id: str | None = None
    """A tool message's: the call it answers."""

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def chat_message(self, where: str) -> ChatMessage:
        """The message for the chat template; ``where``: its field (``messages[2]``)."""
        if self.tool_calls and self.role != "assistant":
            raise InvalidArgument(
                f"{where}.tool_calls: only an assistant message calls tools",
                param=f"{where}.tool_calls",
            )
        if self.content is None and not self.tool_calls:
            raise InvalidArgument(
                f"{where}.content is missing: only an assistant message with tool_calls "
                "may leave it out",
                param=f"{where}.content",
            )
        if (self.role == "tool") != (self.tool_call_id is not None):
            needs = "needs" if self.role == "tool" else "is only for a message of role tool:"
            raise InvalidArgument(
                f"{where}.tool_call_id {needs} the id of the call it answers",
                param=f"{where}.tool_call_id",
            )
        calls = []
        for i, call in enumerate(self.tool_calls or ()):
            try:
                json.loads(call.function.arguments)
            except json.JSONDecodeError as exc:
                field = f"{where}.tool_calls[{i}].function.arguments"
                raise InvalidArgument(f"{field} is not JSON: {exc}", param=field) from None
            calls.append(ToolCall(call.id, call.function.name, call.function.arguments))
        return ChatMessage(self.role, self.text, tuple(calls), self.tool_call_id)


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's rule for a function's name."""


class FunctionDefinition(Body):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema; None: the function takes none."""
    strict: bool | None = None
    """No effect: "required" and a named tool_choice always follow the schema."""


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice,
    one_of('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'),
]


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with include_usage, every chunk carries its choice's usage so far."""


Stop = Annotated[str | list[str] | None, one_of("a string or a list of strings")]

UNCHANGED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "repetition_penalty": (None, 1.0),
}
"""OpenAI's (and vLLM's) parameters that Outrider does not implement, and
the values at which they change nothing. (``repetition_penalty``: the
target would have to apply it at each position it verifies.)"""

BACKENDS = ("auto", "guidance", "llguidance")
"""vLLM's ``guided_decoding_backend`` values Outrider's grammars (llguidance's) answer."""


class JsonSchema(Body):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(Body):
    """vLLM's ``structured_outputs``: one of its fields."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def json_text(schema: str | dict[str, Any]) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


class GenerationBody(Body):
    """What both endpoints take."""

    model: str | None = None
    """None: the served model."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    """OpenAI's default: sampling at temperature 1."""
    top_p: float = 1.0
    seed: int | None = None
    stop: Stop = None
    n: int | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None

    # OpenAI's parameters that Outrider implements only where they change nothing.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    # vLLM's extra parameters, with vLLM's meaning.
    top_k: int = 0
    """0 (or vLLM's -1): off."""
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    """No effect, as in vLLM with a fast tokenizer (the only kind Outrider loads)."""
    repetition_penalty: float | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_decoding_backend: str | None = None

    # Outrider's own.
    num_speculative_tokens: int | None = None
    adaptive: bool = False
    verification: Literal["greedy", "rejection", "gumbel"] | None = None
    pipeline: bool | None = None

    def check_supported(self) -> None:
        """Refuses what Outrider does not implement (see :data:`UNCHANGED`)."""
        for name in type(self).model_fields.keys() & UNCHANGED.keys():
            value = getattr(self, name)
            # By type too: completions' logprobs = 0 asks for logprobs, False does not.
            if not any(type(value) is type(v) and value == v for v in UNCHANGED[name]):
                raise InvalidArgument(
                    f"{name} = {value!r} is not supported by Outrider: leave it out", param=name
                )
        if self.guided_decoding_backend not in (None, *BACKENDS):
            raise InvalidArgument(
                f"guided_decoding_backend = {self.guided_decoding_backend!r}: Outrider's "
                f"grammars are llguidance's; send one of {', '.join(BACKENDS)} or leave it out",
                param="guided_decoding_backend",
            )
        if self.stream_options is not None and not self.stream:
            raise InvalidArgument(
                "stream_options is only allowed when stream is true", param="stream_options"
            )

    def constraints(self) -> dict[str, StructuredOutput]:
        """The structured outputs the body asks for, by the field that asks."""
        found = {}
        if self.guided_json is not None:
            found["guided_json"] = StructuredOutput("json_schema", json_text(self.guided_json))
        if self.guided_regex is not None:
            found["guided_regex"] = StructuredOutput("regex", self.guided_regex)
        if self.guided_choice is not None:
            found["guided_choice"] = StructuredOutput("choice", json.dumps(self.guided_choice))
        if self.guided_grammar is not None:
            found["guided_grammar"] = StructuredOutput("grammar", self.guided_grammar)
        if (outputs := self.structured_outputs) is not None:
            given = {
                "json": outputs.json_ is not None
                and StructuredOutput("json_schema", json_text(outputs.json_)),
                "regex": outputs.regex is not None and StructuredOutput("regex", outputs.regex),
                "choice": outputs.choice is not None
                and StructuredOutput("choice", json.dumps(outputs.choice)),
                "grammar": outputs.grammar is not None
                and StructuredOutput("grammar", outputs.grammar),
                "json_object": bool(outputs.json_object) and StructuredOutput("json_object"),
            }
            found |= {f"structured_outputs.{k}": v for k, v in given.items() if v}
        return found

    def structured_output(self) -> tuple[StructuredOutput | None, str]:
        """The one structured output the body asks for (None: none), and the
        field that asks; two at once are refused."""
        found = self.constraints()
        if len(found) > 1:
            raise InvalidArgument(
                f"{' and '.join(found)} each constrain the output: give one of them",
                param=next(iter(found)),
            )
        return next(((v, k) for k, v in found.items()), (None, ""))

    @property
    def num_logprobs(self) -> int | None:
        """How many most likely tokens each position reports (None: no logprobs)."""
        return None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM's continuous_usage_stats, with include_usage."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


class ChatCompletionRequest(GenerationBody):
    """``POST /v1/chat/completions``."""

    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    """None: "auto" with tools, else "none"."""
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    prediction: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    def constraints(self) -> dict[str, StructuredOutput]:
        found = {**self.response_format_constraint(), **super().constraints()}
        if (calls := self.tool_call_constraint()) is not None:
            found["tool_choice"] = calls  # last: a clash names the other field
        return found

    def response_format_constraint(self) -> dict[str, StructuredOutput]:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return {}
        if rf.type == "json_object":
            return {"response_format": StructuredOutput("json_object")}
        if rf.json_schema is None:
            raise InvalidArgument(
                "response_format of type json_schema needs its json_schema ({name, schema})",
                param="response_format.json_schema",
            )
        schema = json.dumps(rf.json_schema.schema_)
        return {"response_format": StructuredOutput("json_schema", schema)}

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How the request uses its tools (see docs/openai-api.md#tool-calls)."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        return "named" if isinstance(choice, NamedToolChoice) else choice

    def rendered_tools(self) -> list[dict[str, Any]]:
        """The tools the prompt lists (none under tool_choice "none"), as sent."""
        if self.tool_mode == "none":
            return []
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]

    def tool_call_constraint(self) -> StructuredOutput | None:
        """The grammar of the calls "required" or a named function asks for."""
        mode, tools = self.tool_mode, self.tools or []
        names = [tool.function.name for tool in tools]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise InvalidArgument(
                    f"tools[{i}].function.name = {name!r} is the name of an earlier tool: "
                    "give each tool its own name",
                    param=f"tools[{i}].function.name",
                )
        if mode in ("none", "auto"):
            return None
        if not tools:
            raise InvalidArgument(
                f"tool_choice asks for a tool call ({mode}) but the request has no tools",
                param="tool_choice",
            )
        if isinstance(choice := self.tool_choice, NamedToolChoice):
            if choice.function.name not in names:
                raise InvalidArgument(
                    f"tool_choice names the function {choice.function.name!r}, which is not "
                    f"among the tools ({', '.join(names)})",
                    param="tool_choice",
                )
            tools = [tools[names.index(choice.function.name)]]
        functions = [(t.function.name, t.function.parameters) for t in tools]
        many = mode == "required" and self.parallel_tool_calls is not False
        return StructuredOutput("grammar", call_grammar(functions, many=many))

    def chat_messages(self) -> list[ChatMessage]:
        return [m.chat_message(f"messages[{i}]") for i, m in enumerate(self.messages)]

    @property
    def num_logprobs(self) -> int | None:
        """How many most likely tokens each position reports (None: no logprobs)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidArgument("top_logprobs needs logprobs = true", param="top_logprobs")
        if not self.logprobs:
            return None
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise InvalidArgument(
                f"top_logprobs = {top}: give 0 to {MAX_LOGPROBS}", param="top_logprobs"
            )
        return top

    def token_limit(self) -> tuple[str, int | None]:
        """The token limit and the field that set it: ``max_completion_tokens``
        (OpenAI's current name) or ``max_tokens`` (its former one)."""
        if self.max_completion_tokens is None:
            return "max_tokens", self.max_tokens
        if self.max_tokens not in (None, self.max_completion_tokens):
            raise InvalidArgument(
                f"max_tokens = {self.max_tokens} and max_completion_tokens = "
                f"{self.max_completion_tokens} differ: give one of them",
                param="max_completion_tokens",
            )
        return "max_completion_tokens", self.max_completion_tokens


Prompt = Annotated[
    str | list[int] | list[str] | list[list[int]],
    one_of("a string, a list of token ids, or a list of either"),
]


class CompletionRequest(GenerationBody):
    """``POST /v1/completions``."""

    prompt: Prompt
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    @property
    def num_logprobs(self) -> int | None:
        """How many most likely tokens each position reports (None: no logprobs)."""
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(
                f"logprobs = {self.logprobs}: give 0 to {MAX_LOGPROBS}", param="logprobs"
            )
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, self.n or 1):
            raise InvalidArgument(
                f"best_of = {self.best_of} is not supported by Outrider unless it equals n "
                f"({self.n or 1}): leave it out",
                param="best_of",
            )

    @property
    def prompts(self) -> list[str | list[int]]:
        """One prompt per choice: a string or a list of token ids each."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)  # type: ignore[arg-type]
