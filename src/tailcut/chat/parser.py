"""Tool-call parsers: assistant text → tool calls and parse errors, in text order.

The hermes format (Qwen2.5, NousResearch) puts each call in its own block, several per
turn::

    <tool_call>
    {"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}
    </tool_call>

A block that cannot be used (bad JSON, no name, arguments that are not an object, an
unterminated block, a block over the size limit) becomes a :class:`ToolCallError`; the
agent loop answers it with a tool message explaining the error, and the trajectory goes on.
Parsing never raises.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tailcut.chat.template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str
    """The text between the tags, as the model wrote it."""


@dataclass(frozen=True, slots=True)
class ToolCallError:
    reason: str
    raw: str
    name: str | None = None
    """The tool name, when the block got far enough to tell."""

    def message(self) -> str:
        """The tool message the model reads."""
        return (
            f"Error: could not parse tool call: {self.reason}. Write each call as "
            f'{TOOL_CALL_OPEN}{{"name": <function-name>, "arguments": <args-json-object>}}'
            f"{TOOL_CALL_CLOSE}."
        )


@dataclass(slots=True)
class ParsedTurn:
    content: str
    """The assistant text with the tool-call blocks removed."""
    items: list[ToolCall | ToolCallError] = field(default_factory=list)

    @property
    def calls(self) -> list[ToolCall]:
        return [item for item in self.items if isinstance(item, ToolCall)]

    @property
    def errors(self) -> list[ToolCallError]:
        return [item for item in self.items if isinstance(item, ToolCallError)]


class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn."""

    def __init__(self, max_call_chars: int = 16_384) -> None:
        self.max_call_chars = max_call_chars
        self._block = re.compile(
            re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL
        )

    def parse(self, text: str) -> ParsedTurn:
        items: list[ToolCall | ToolCallError] = []
        pieces: list[str] = []
        pos = 0
        for match in self._block.finditer(text):
            pieces.append(text[pos : match.start()])
            items.append(self._one(match.group(1)))
            pos = match.end()
        tail = text[pos:]
        open_at = tail.find(TOOL_CALL_OPEN)
        if open_at >= 0:
            raw = tail[open_at + len(TOOL_CALL_OPEN) :]
            items.append(ToolCallError(f"{TOOL_CALL_OPEN} block is not closed", raw))
            tail = tail[:open_at]
        pieces.append(tail)
        return ParsedTurn(content="".join(pieces).strip(), items=items)

    def _one(self, raw: str) -> ToolCall | ToolCallError:
        if len(raw) > self.max_call_chars:
            return ToolCallError(
                f"the call is {len(raw)} characters long, the limit is {self.max_call_chars}",
                raw[:200],
            )
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            return ToolCallError(
                f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})", raw
            )
        if not isinstance(obj, dict):
            return ToolCallError(f"expected a JSON object, got {type(obj).__name__}", raw)
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            return ToolCallError("missing 'name' (a non-empty string)", raw)
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models send the arguments JSON-encoded
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                return ToolCallError(f"'arguments' string is not JSON ({exc.msg})", raw, name)
        if args is None:
            args = {}
        if not isinstance(args, dict):
            return ToolCallError(
                f"'arguments' must be a JSON object, got {type(args).__name__}", raw, name
            )
        return ToolCall(name=name, arguments=args, raw=raw)


PARSERS: dict[str, Callable[..., ToolParser]] = {"hermes": HermesParser}
"""Parser factories by name (``AgentLoopConfig.tool_parser``)."""


def get_parser(name: str, **kwargs: Any) -> ToolParser:
    try:
        factory = PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool parser {name!r}; known: {', '.join(sorted(PARSERS))}"
        ) from None
    return factory(**kwargs)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A hermes tool-call block (what a model is asked to write; used by tests and scripts)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"
