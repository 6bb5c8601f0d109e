"""Mistral ``[TOOL_CALLS]`` tool calls (``tool_parser: mistral``), both layouts:

* v3 tokenizers (Mistral-7B-Instruct-v0.3, Mixtral-8x22B, Nemo): one JSON list of calls
  after the token, each with a 9-character ``id``::

      [TOOL_CALLS] [{"name": "code_interpreter", "arguments": {"code": "..."}, "id": "a1b2c3d4e"}]

* v11+ tokenizers (Mistral Small 3.2, Magistral, Devstral): each call is the function
  name and its JSON arguments, the id (where the model writes one) in ``[CALL_ID]``::

      [TOOL_CALLS]code_interpreter[ARGS]{"code": "..."}[TOOL_CALLS]other[ARGS]{...}

Text before the first ``[TOOL_CALLS]`` and after the last call is content. A segment that
does not decode (bad JSON, no ``[ARGS]``, no name, arguments that are not an object, over
the size limit) is a :class:`~tailcut.chat.tool_calls.ToolCallError`; parsing never raises.
"""

from __future__ import annotations

import json
import re
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

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
LIST_HINT = (
    'Write the calls as [TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}].'
)
ARGS_HINT = "Write each call as [TOOL_CALLS]<function-name>[ARGS]<args-json-object>."
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def format_mistral_call(
    name: str, arguments: dict[str, Any], *, call_id: str | None = None, layout: str = "list"
) -> str:
    """A Mistral tool call: the v3 JSON list (``layout="list"``) or the v11 ``[ARGS]`` form."""
    args = json.dumps(arguments, ensure_ascii=False)
    if layout == "args":
        ident = f"{CALL_ID}{call_id}" if call_id else ""
        return f"{TOOL_CALLS}{name}{ident}{ARGS}{args}"
    call: dict[str, Any] = {"name": name, "arguments": arguments}
    if call_id:
        call["id"] = call_id
    return f"{TOOL_CALLS}{json.dumps([call], ensure_ascii=False)}"


class MistralParser:
    """Mistral ``[TOOL_CALLS]`` calls in either layout (module docstring)."""

    structured_history = True
    """Assistant turns enter the conversation as ``tool_calls`` with 9-character ids, which
    Mistral's templates require (:mod:`tailcut.chat.history`)."""

    def __init__(self, max_call_chars: int = 16_384) -> None:
        self.max_call_chars = max_call_chars

    def parse(self, text: str) -> ParsedTurn:
        head, *segments = text.split(TOOL_CALLS)
        items: list[ToolCall | ToolCallError] = []
        tails: list[str] = []
        for segment in segments:
            tail = self._segment(segment, items)
            if tail.strip():
                tails.append(tail.strip())
        content = "\n".join(p for p in (head.strip(), *tails) if p)
        return ParsedTurn(content=content, items=items)

    def _segment(self, segment: str, items: list[ToolCall | ToolCallError]) -> str:
        """Append the calls of one ``[TOOL_CALLS]`` segment; return the text after them."""
        stripped = segment.lstrip()
        if stripped.startswith(("[", "{")):
            return self._json_calls(stripped, items)
        return self._args_call(stripped, items)

    def _json_calls(self, text: str, items: list[ToolCall | ToolCallError]) -> str:
        try:
            value, end = decode_prefix(text)
        except json.JSONDecodeError as exc:
            items.append(
                too_long(text, self.max_call_chars, LIST_HINT)
                or ToolCallError(json_error(exc), text, hint=LIST_HINT)
            )
            return ""
        raw = text[:end]
        error = too_long(raw, self.max_call_chars, LIST_HINT)
        if error is not None:
            items.append(error)
        elif isinstance(value, list) and not value:
            items.append(ToolCallError("the list of calls is empty", raw, hint=LIST_HINT))
        else:
            for obj in value if isinstance(value, list) else [value]:
                items.append(call_from_object(obj, raw, LIST_HINT))
        return text[end:]

    def _args_call(self, text: str, items: list[ToolCall | ToolCallError]) -> str:
        at = text.find(ARGS)
        if at < 0:
            items.append(
                ToolCallError(
                    f"{TOOL_CALLS} is followed neither by a JSON list of calls nor by "
                    f"<function-name>{ARGS}<args-json-object>",
                    text[:200],
                    hint=ARGS_HINT,
                )
            )
            return ""
        name, _, call_id = text[:at].partition(CALL_ID)
        name = name.strip()
        body = text[at + len(ARGS) :]
        if not _NAME.match(name):
            items.append(
                ToolCallError(
                    f"bad function name {name[:64]!r} before {ARGS}", text, hint=ARGS_HINT
                )
            )
            return ""
        try:
            args, end = decode_prefix(body)
        except json.JSONDecodeError as exc:
            raw = text
            items.append(
                too_long(raw, self.max_call_chars, ARGS_HINT)
                or ToolCallError(f"arguments: {json_error(exc)}", raw, name, ARGS_HINT)
            )
            return ""
        raw = text[: at + len(ARGS) + end]
        error = too_long(raw, self.max_call_chars, ARGS_HINT)
        obj = {"name": name, "arguments": args}
        if call_id.strip():
            obj["id"] = call_id.strip()
        items.append(error or call_from_object(obj, raw, ARGS_HINT))
        return body[end:]
