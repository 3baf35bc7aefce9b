"""Chat messages, with tools and tool calls, rendered into a prompt through
the target's chat template (docs/openai-api.md#tool-calls).

Two paths, chosen by the template:

* **the template's own** — a template that mentions ``tools`` (Qwen2.5's,
  Llama 3.1's, Hermes 3's, ...) gets the tools, the assistant messages'
  ``tool_calls`` (their arguments as objects, as transformers documents)
  and the ``tool`` messages as they are;
* **Hermes-style** — any other template (SmolLM2's ignores tools) gets
  plain messages written as Qwen2.5's template writes tools: a system
  block listing them in ``<tools></tools>`` and asking for calls as
  ``<tool_call>`` JSON blocks, an assistant's calls as those blocks in its
  content, and tool results as a user message of ``<tool_response>``
  blocks.

Either way the model is asked to call tools in Hermes' ``<tool_call>``
blocks, the format ``outrider.coordinator.openai.tool_calls`` parses.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""Qwen2.5's words for the tools (its template's system block)."""


@dataclass(frozen=True)
class ToolCall:
    """A call of a function: an assistant message's, or one parsed from the output."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's form)."""

    def block(self) -> str:
        """The call as a Hermes ``<tool_call>`` block."""
        call = f'{{"name": {json.dumps(self.name)}, "arguments": {self.arguments}}}'
        return f"{TOOL_CALL_START}\n{call}\n{TOOL_CALL_END}"

    def for_template(self) -> dict[str, Any]:
        """As transformers' chat templates read a call: the arguments as an
        object when they are one (a template writes them with ``tojson``)."""
        try:
            arguments: Any = json.loads(self.arguments)
        except json.JSONDecodeError:
            arguments = self.arguments
        function = {"name": self.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant message's calls."""
    tool_call_id: str | None = None
    """A tool message's: the call it answers."""


def uses_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` itself."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one, or a "tool_use" one
        return "tool_use" in template or "tools" in template.get("default", "")
    return isinstance(template, str) and "tools" in template


def render(
    tokenizer: Any, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] = ()
) -> list[int]:
    """The prompt's token ids: ``messages`` (and ``tools``, OpenAI's tool
    objects) through the tokenizer's chat template, ready for the reply."""
    chat: list[dict[str, Any]]
    extra: dict[str, Any] = {}
    if uses_tools(tokenizer):
        chat = [template_message(m) for m in messages]
        if tools:
            extra["tools"] = list(tools)
    else:
        chat = list(hermes_messages(messages, tools))
    return list(
        tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=True, **extra
        )["input_ids"]
    )


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as transformers' templates read it."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [call.for_template() for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def hermes_messages(
    messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]]
) -> list[dict[str, str]]:
    """Plain ``{role, content}`` messages that write the tools, the calls and
    their results in Hermes' markup, as Qwen2.5's template writes them."""
    chat: list[dict[str, str]] = []
    if tools:
        listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
        system = TOOLS_PROMPT.format(tools=listed)
        if messages and messages[0].role == "system":
            system = f"{messages[0].content}\n\n{system}"
            messages = messages[1:]
        chat.append({"role": "system", "content": system})
    previous = ""
    for message in messages:
        if message.role == "tool":
            response = f"<tool_response>\n{message.content}\n</tool_response>"
            if previous == "tool":  # results in a row: one user message
                chat[-1]["content"] += "\n" + response
            else:
                chat.append({"role": "user", "content": response})
        else:
            blocks = [call.block() for call in message.tool_calls]
            content = "\n".join([message.content, *blocks] if message.content else blocks)
            chat.append({"role": message.role, "content": content})
        previous = message.role
    return chat
