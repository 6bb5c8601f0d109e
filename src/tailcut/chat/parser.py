"""Tool-call parsers: assistant text → tool calls and parse errors, in text order.

One parser per model family's format, by name (``agent.tool_parser``):

* ``hermes`` — Qwen2.5 / Qwen3, NousResearch Hermes: each call in its own block, several
  per turn::

      <tool_call>
      {"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}
      </tool_call>

* ``llama3_json`` — Llama 3.x: the message is the JSON call, arguments under
  ``parameters`` (:mod:`tailcut.chat.parser_llama`);
* ``mistral`` — ``[TOOL_CALLS]`` followed by a JSON list (v3) or ``name[ARGS]{...}`` (v11+)
  (:mod:`tailcut.chat.parser_mistral`);
* ``auto`` — the format the model's chat template names (:func:`detect_tool_parser`: its
  call markers); without a template (or one that names none), each turn is read in the
  format whose marker it holds.

A call that cannot be used (bad JSON, no name, arguments that are not an object, an
unterminated block, a call over the size limit) becomes a :class:`ToolCallError` whose
message explains the format; the agent loop answers it with a tool message, and the
trajectory goes on. Parsing never raises.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tailcut.chat.parser_llama import PYTHON_TAG, Llama3JsonParser
from tailcut.chat.parser_mistral import TOOL_CALLS, MistralParser
from tailcut.chat.template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from tailcut.chat.tool_calls import (
    HERMES_HINT,
    ParsedTurn,
    ToolCall,
    ToolCallError,
    ToolParser,
    call_from_object,
    decode_prefix,
    json_error,
    too_long,
)

__all__ = [
    "PARSERS",
    "AutoParser",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedTurn",
    "ToolCall",
    "ToolCallError",
    "ToolParser",
    "detect_tool_parser",
    "format_tool_call",
    "get_parser",
]


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn."""

    def __init__(self, max_call_chars: int = 16_384) -> None:
        self.max_call_chars = max_call_chars

    def parse(self, text: str) -> ParsedTurn:
        items: list[ToolCall | ToolCallError] = []
        pieces: list[str] = []
        pos = 0
        while (open_at := text.find(TOOL_CALL_OPEN, pos)) >= 0:
            pieces.append(text[pos:open_at])
            start = open_at + len(TOOL_CALL_OPEN)
            close = _block_close(text, start)
            if close < 0:
                items.append(ToolCallError(f"{TOOL_CALL_OPEN} block is not closed", text[start:]))
                pos = len(text)
                break
            items.append(self._one(text[start:close]))
            pos = close + len(TOOL_CALL_CLOSE)
        pieces.append(text[pos:])
        return ParsedTurn(content="".join(pieces).strip(), items=items)

    def _one(self, raw: str) -> ToolCall | ToolCallError:
        error = too_long(raw, self.max_call_chars, HERMES_HINT)
        if error is not None:
            return error
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            return ToolCallError(json_error(exc), raw)
        return call_from_object(obj, raw, HERMES_HINT)


def _block_close(text: str, start: int) -> int:
    """Where the ``</tool_call>`` that closes the block whose body starts at ``start`` is:
    the first after the JSON value the body starts with (a ``</tool_call>`` inside a JSON
    string, say in code that prints it, does not end the call), else the first after
    ``start`` (a malformed body); -1 when there is none."""
    try:
        _, end = decode_prefix(text[start:])
    except json.JSONDecodeError:
        end = 0
    return text.find(TOOL_CALL_CLOSE, start + end)


class AutoParser:
    """Each turn in the format whose call marker it holds (``[TOOL_CALLS]``, then
    ``<tool_call>``, then a Llama JSON call); a turn with none has no calls."""

    def __init__(self, max_call_chars: int = 16_384) -> None:
        self.hermes = HermesParser(max_call_chars)
        self.llama = Llama3JsonParser(max_call_chars)
        self.mistral = MistralParser(max_call_chars)

    def parse(self, text: str) -> ParsedTurn:
        if TOOL_CALLS in text:
            return self.mistral.parse(text)
        if TOOL_CALL_OPEN in text:
            return self.hermes.parse(text)
        return self.llama.parse(text)


PARSERS: dict[str, Callable[..., ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "auto": AutoParser,
}
"""Parser factories by name (``AgentLoopConfig.tool_parser``)."""

_MISTRAL_MARKERS = (TOOL_CALLS, "[AVAILABLE_TOOLS]", "[TOOL_RESULTS]")
_LLAMA_MARKERS = (PYTHON_TAG, '"parameters": dictionary of argument name')


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool-call markers name: ``mistral`` (``[TOOL_CALLS]``,
    ``[AVAILABLE_TOOLS]``, ``[TOOL_RESULTS]``),
    ``hermes`` (``<tool_call>``), ``llama3_json`` (``<|python_tag|>`` or Llama's
    ``"parameters"`` instruction); None when it names none."""
    if not chat_template:
        return None
    if any(marker in chat_template for marker in _MISTRAL_MARKERS):
        return "mistral"
    if TOOL_CALL_OPEN in chat_template:
        return "hermes"
    if any(marker in chat_template for marker in _LLAMA_MARKERS):
        return "llama3_json"
    return None


def get_parser(name: str, *, chat_template: str | None = None, **kwargs: Any) -> ToolParser:
    """The parser called ``name``; ``auto`` picks the one ``chat_template`` names
    (:func:`detect_tool_parser`), else reads each turn by its markers (:class:`AutoParser`)."""
    if name == "auto":
        name = detect_tool_parser(chat_template) or "auto"
    try:
        factory = PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(PARSERS)}") from None
    return factory(**kwargs)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A hermes tool-call block (what a model is asked to write; used by tests and scripts)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"
