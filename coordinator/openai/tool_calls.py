"""Tool calls in Hermes' format (``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``, which Qwen, Hermes and many others emit and which
``outrider.coordinator.chat_template`` asks for): the parser that turns a choice's
output into content and calls, as the output grows, and the grammar that
makes the model call a tool (``tool_choice`` ``"required"`` or a named
function).

The parser reads a block as a call when it holds a JSON object with a
string ``name`` and an object ``arguments``; any other block, and a block
left open when the output ends, stays content (as vLLM's Hermes parser
does). The content is the text outside the calls, less the whitespace that
separates them from it. Streamed, the content is held back only where a
``<tool_call>`` may be starting (and trailing whitespace, which a call may
swallow); a call is sent whole once its block closes. A stream's pieces add
up to the whole output's parse: both come from one :class:`ToolCallParser`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from outrider.coordinator.chat_template import TOOL_CALL_END, TOOL_CALL_START, ToolCall
from outrider.grammar import JSON_LAYOUT

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments of a function that declares no ``parameters`` (OpenAI's
meaning: it takes none)."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_call(block: str) -> tuple[str, str] | None:
    """The function name and arguments (JSON text) a block's JSON calls; None: not a call."""
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def partial_start(text: str) -> int:
    """The length of the longest end of ``text`` that may begin a ``<tool_call>``."""
    for length in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-length:]):
            return length
    return 0


class ToolCallParser:
    """Splits one choice's output, fed piece by piece, into content and calls."""

    def __init__(self) -> None:
        self.text = ""
        self.done = 0
        """Where the text not yet split begins."""
        self.held = ""
        """Trailing whitespace of the content, sent once content follows it."""
        self.after_call = False
        """Whether the content so far ends with a call (its leading whitespace is dropped)."""
        self.calls: list[ToolCall] = []

    def feed(self, piece: str, *, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The content and the calls that ``piece``, the output's next text,
        completes; ``final``: the output ends with it."""
        self.text += piece
        content, calls = [], []
        while (start := self.text.find(TOOL_CALL_START, self.done)) >= 0:
            content.append(self.outside(self.text[self.done : start]))
            end = self.text.find(TOOL_CALL_END, start)
            if end < 0:  # an open block: wait for its end, or keep it as content
                self.done = start
                break
            self.done = end + len(TOOL_CALL_END)
            call = read_call(self.text[start + len(TOOL_CALL_START) : end])
            if call is None:
                content.append(self.outside(self.text[start : self.done]))
            else:
                self.held, self.after_call = "", True
                calls.append(ToolCall(new_call_id(), *call))
        else:
            split = len(self.text) - (0 if final else partial_start(self.text[self.done :]))
            content.append(self.outside(self.text[self.done : split]))
            self.done = split
        if final:
            content += [self.outside(self.text[self.done :]), self.held]
            self.done, self.held = len(self.text), ""
        self.calls += calls
        return "".join(content), calls

    def outside(self, text: str) -> str:
        """The content to send of ``text``, which is outside any call."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return ""
            self.after_call = False
        text = self.held + text
        sent = text.rstrip()
        self.held = text[len(sent) :]
        return sent


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """A whole output's content and calls."""
    return ToolCallParser().feed(text, final=True)


def finish_reason(reason: str | None, *, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` for an output that called tools and stopped by itself."""
    return "tool_calls" if called and reason == "stop" else reason


def message_call(call: ToolCall) -> dict[str, Any]:
    """A call as a message's ``tool_calls`` entry."""
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}


def delta_call(call: ToolCall, index: int) -> dict[str, Any]:
    """A call as a stream's delta carries it: whole, with its index among the choice's calls."""
    return {"index": index, **message_call(call)}


def call_grammar(functions: Sequence[tuple[str, dict[str, Any] | None]], *, many: bool) -> str:
    """A Lark grammar (llguidance's, whose ``%json`` takes a JSON schema)
    of Hermes blocks calling ``functions`` (each a name and its parameters'
    schema; None: it takes none): one block, or with ``many`` one or more,
    each with arguments that follow its function's schema."""
    rules = []
    for i, (name, parameters) in enumerate(functions):
        schema = {
            "x-guidance": JSON_LAYOUT,
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": NO_PARAMETERS if parameters is None else parameters,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        rules.append(f"call_{i}: %json {json.dumps(schema)}")
    return "\n".join(
        [
            'start: block ("\\n" block)*' if many else "start: block",
            f'block: "{TOOL_CALL_START}\\n" call "\\n{TOOL_CALL_END}"',
            "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
            *rules,
        ]
    )
