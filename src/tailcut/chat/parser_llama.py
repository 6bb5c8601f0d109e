"""Llama 3.x JSON tool calls (``tool_parser: llama3_json``).

Llama 3.1 / 3.2 / 3.3 answer a custom tool with the call itself as the assistant message,
a JSON object with the arguments under ``parameters``, optionally after the
``<|python_tag|>`` token::

    {"name": "code_interpreter", "parameters": {"code": "print(2 ** 10)"}}

A message is a call when it holds ``<|python_tag|>`` (the text before it is content) or
when it starts with ``{``, as vLLM's ``llama3_json`` parser reads it. Several calls may
follow each other, separated by ``;`` (after the tag, also as one JSON list); ``arguments``
is accepted in place of ``parameters``. Text after the last call is content. A call that
does not decode or has no name is a :class:`~tailcut.chat.tool_calls.ToolCallError`;
parsing never raises.
"""

from __future__ import annotations

import json
from typing import Any

from tailcut.chat.tool_calls import (
    ParsedTurn,
    ToolCall,
    ToolCallError,
    call_from_object,
    decode_prefix,
    json_error,
    too_long,
)

PYTHON_TAG = "<|python_tag|>"
END_TOKENS = ("<|eom_id|>", "<|eot_id|>")
"""End-of-message tokens a Llama model may leave at the end of a decoded call."""
LLAMA3_HINT = (
    'Write a call as the whole message, a JSON object {"name": <function-name>, '
    '"parameters": <args-json-object>} (several calls separated by ";").'
)
ARGS_KEYS = ("parameters", "arguments")


def format_llama3_call(name: str, arguments: dict[str, Any]) -> str:
    """A Llama 3.x JSON tool call (what the model is asked to write)."""
    return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


class Llama3JsonParser:
    """Llama 3.x JSON tool calls (module docstring), any number per turn."""

    def __init__(self, max_call_chars: int = 16_384) -> None:
        self.max_call_chars = max_call_chars

    def parse(self, text: str) -> ParsedTurn:
        for end in END_TOKENS:
            text = text.replace(end, "")
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            head, calls = text[:tag], text[tag + len(PYTHON_TAG) :]
        elif text.lstrip().startswith("{"):
            head, calls = "", text
        else:
            return ParsedTurn(content=text.strip())
        items, tail = self._calls(calls)
        content = "\n".join(p for p in (head.strip(), tail.strip()) if p)
        return ParsedTurn(content=content, items=items)

    def _calls(self, text: str) -> tuple[list[ToolCall | ToolCallError], str]:
        """The calls at the start of ``text`` and the text after them."""
        items: list[ToolCall | ToolCallError] = []
        rest = text
        while rest.strip():
            start = len(rest) - len(rest.lstrip())
            try:
                value, end = decode_prefix(rest)
            except json.JSONDecodeError as exc:
                raw = rest[start:]
                items.append(
                    too_long(raw, self.max_call_chars, LLAMA3_HINT)
                    or ToolCallError(json_error(exc), raw, hint=LLAMA3_HINT)
                )
                return items, ""
            raw = rest[start:end]
            for obj in value if isinstance(value, list) and value else [value]:
                items.append(self._one(obj, raw))
            rest = rest[end:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:]
            elif not rest.startswith("{"):
                return items, rest
        return items, ""

    def _one(self, obj: Any, raw: str) -> ToolCall | ToolCallError:
        error = too_long(raw, self.max_call_chars, LLAMA3_HINT)
        return error or call_from_object(obj, raw, LLAMA3_HINT, ARGS_KEYS)
