"""What a tool-call parser returns, whatever the model family's format: calls, parse errors
and the assistant text around them (:mod:`tailcut.chat.parser` picks the parser).

A call that cannot be used (bad JSON, no name, arguments that are not an object, an
unterminated block, a call over the size limit) is a :class:`ToolCallError`, never an
exception: the agent loop answers it with a tool message that explains the error in the
format's own terms (:meth:`ToolCallError.message`), and the trajectory goes on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

HERMES_HINT = (
    'Write each call as <tool_call>{"name": <function-name>, "arguments": <args-json-object>}'
    "</tool_call>."
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str
    """The text of the call, as the model wrote it (between the tags, for tagged formats)."""
    id: str | None = None
    """The call id the model wrote, in formats that carry one (Mistral's ``"id"``)."""


@dataclass(frozen=True, slots=True)
class ToolCallError:
    reason: str
    raw: str
    name: str | None = None
    """The tool name, when the call got far enough to tell."""
    hint: str = HERMES_HINT
    """How a well-formed call of the parser's format is written (told to the model)."""

    def message(self) -> str:
        """The tool message the model reads."""
        return f"Error: could not parse tool call: {self.reason}. {self.hint}"


@dataclass(slots=True)
class ParsedTurn:
    content: str
    """The assistant text with the tool calls removed."""
    items: list[ToolCall | ToolCallError] = field(default_factory=list)
    """Calls and parse errors, in text order."""

    @property
    def calls(self) -> list[ToolCall]:
        return [item for item in self.items if isinstance(item, ToolCall)]

    @property
    def errors(self) -> list[ToolCallError]:
        return [item for item in self.items if isinstance(item, ToolCallError)]


class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


def too_long(raw: str, limit: int, hint: str) -> ToolCallError | None:
    """The error for a call over ``limit`` characters (its start kept), or None."""
    if len(raw) <= limit:
        return None
    return ToolCallError(
        f"the call is {len(raw)} characters long, the limit is {limit}", raw[:200], hint=hint
    )


def json_error(exc: json.JSONDecodeError) -> str:
    return f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"


def call_from_object(
    obj: Any, raw: str, hint: str, args_keys: tuple[str, ...] = ("arguments",)
) -> ToolCall | ToolCallError:
    """A decoded ``{"name": ..., <args key>: {...}}`` object as a call, or the error that
    says what is wrong with it. The first of ``args_keys`` present holds the arguments (an
    object, a JSON-encoded object, null or absent); a string ``"id"`` is kept."""
    if not isinstance(obj, dict):
        return ToolCallError(f"expected a JSON object, got {type(obj).__name__}", raw, hint=hint)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError("missing 'name' (a non-empty string)", raw, hint=hint)
    key = next((k for k in args_keys if k in obj), None)
    if key is None:
        other = sorted(k for k in obj if k not in ("name", "id", "type"))
        if other:  # arguments under another name would be dropped without a word
            return ToolCallError(
                f"no {args_keys[0]!r} (unknown key {', '.join(map(repr, other))}; the "
                f"arguments go under {args_keys[0]!r})",
                raw, name, hint,
            )  # fmt: skip
        key = args_keys[0]
    args = obj.get(key)
    if isinstance(args, str):  # some models send the arguments JSON-encoded
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCallError(f"{key!r} string is not JSON ({exc.msg})", raw, name, hint)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCallError(
            f"{key!r} must be a JSON object, got {type(args).__name__}", raw, name, hint
        )
    call_id = obj.get("id")
    return ToolCall(name, args, raw, call_id if isinstance(call_id, str) else None)


def decode_prefix(text: str) -> tuple[Any, int]:
    """The JSON value at the start of ``text`` (leading whitespace skipped) and the index
    just past it; ``json.JSONDecodeError`` if there is none."""
    start = len(text) - len(text.lstrip())
    return json.JSONDecoder().raw_decode(text, start)
