"""How sampled assistant turns enter the conversation a chat template renders.

The tokens a model sampled are kept as they are (:mod:`tailcut.chat.tokenize`); the
*messages* only serve the template, to render what comes next. Two forms of an assistant
message, chosen by the tool-call format:

* **text** (hermes, Llama 3.x JSON): ``content`` is the sampled text, calls included. The
  template renders it back verbatim (ChatML) or trimmed (Llama 3.x), so the token stream
  equals the template's rendering whenever the model did not pad its message with
  white space;
* **structured** (Mistral ``[TOOL_CALLS]``): ``content`` is the text outside the calls and
  ``tool_calls`` the parsed calls in OpenAI's shape, each with an ``id`` of 9 letters and
  digits, and every tool message answering them gets that ``tool_call_id``. Mistral's
  templates need this: they refuse call ids of another length and count a plain
  assistant message in their user/assistant alternation, which a tool-call turn must not
  be. The model's own id is kept where it wrote a valid one; otherwise one is derived
  from the conversation (the same conversation gets the same ids). A call that did not
  parse is rendered as a call named ``invalid_tool_call`` so that its error message,
  a tool message, has a call to answer.

Where the template renders a message differently from what was sampled (a trimmed space,
a call id the model did not write, JSON spaced otherwise, a system prompt that Mistral v3
drops from the history once the assistant answers), the stream keeps the sampled tokens —
that is what the policy saw and what training scores — and the difference is recorded as
a :class:`Drift`; later turns are rendered from the template as usual.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tailcut.chat.template import STANDS_FOR
from tailcut.chat.tool_calls import ParsedTurn, ToolCall, ToolParser

CALL_ID_CHARS = 9
_ALNUM = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_VALID_ID = re.compile(rf"^[A-Za-z0-9]{{{CALL_ID_CHARS}}}$")
INVALID_CALL_NAME = "invalid_tool_call"


@dataclass(frozen=True, slots=True)
class Drift:
    """A place where the kept tokens and the template's rendering of the history differ."""

    message: int
    """Index of the assistant message whose addition showed the difference."""
    kind: Literal["assistant", "history"]
    """``assistant``: the message renders otherwise than sampled; ``history``: adding it
    changed how the template renders earlier messages."""
    detail: str


def call_id(seed: str, k: int) -> str:
    """A call id of 9 letters and digits, a pure function of ``seed`` and ``k``."""
    digest = int.from_bytes(hashlib.blake2b(f"{k}:{seed}".encode(), digest_size=8).digest())
    chars = []
    for _ in range(CALL_ID_CHARS):
        digest, r = divmod(digest, len(_ALNUM))
        chars.append(_ALNUM[r])
    return "".join(chars)


def wants_structure(parser: ToolParser | None) -> bool:
    """Whether assistant turns are kept in the structured form for this parser's format."""
    return bool(getattr(parser, "structured_history", False))


def structured_message(parsed: ParsedTurn, seed: str) -> tuple[dict[str, Any], list[str]]:
    """The structured assistant message of a parsed turn and its call ids, in text order
    (one per item: calls and parse errors); no ``tool_calls`` key when the turn has none."""
    ids: list[str] = []
    calls: list[dict[str, Any]] = []
    for k, item in enumerate(parsed.items):
        own = item.id if isinstance(item, ToolCall) else None
        ident = own if own and _VALID_ID.match(own) and own not in ids else call_id(seed, k)
        ids.append(ident)
        if isinstance(item, ToolCall):
            function = {"name": item.name, "arguments": item.arguments}
        else:
            function = {"name": item.name or INVALID_CALL_NAME, "arguments": {}}
        calls.append({"id": ident, "type": "function", "function": function})
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if calls:
        message["tool_calls"] = calls
    return message, ids


def answer_ids(messages: Sequence[dict[str, Any]], ids: Sequence[str]) -> None:
    """Give the tool messages of a turn the call ids they answer, in order (a message that
    already names one keeps it)."""
    pending = iter(ids)
    for message in messages:
        if message.get("role") == "tool" and "tool_call_id" not in message:
            ident = next(pending, None)
            if ident is None:
                return
            message["tool_call_id"] = ident


def closing_text(rendered: str, content: str, stop_text: str) -> str | None:
    """What the template puts after the sampled part of an assistant message: the text
    after the sampled end-of-turn token where the rendering has it, else after the token
    it stands for (``STANDS_FOR``: Llama's ``<|eot_id|>`` where the model sampled
    ``<|eom_id|>``) right after the content, else after the message content (verbatim or
    trimmed); None when none can be found."""
    if stop_text and stop_text in rendered:
        return rendered[rendered.rindex(stop_text) + len(stop_text) :]
    end = STANDS_FOR.get(stop_text)
    if end is not None and rendered.startswith(content + end):
        return rendered[len(content) + len(end) :]
    if rendered.startswith(content):
        return rendered[len(content) :]
    core = content.strip()
    if not core:  # white space only, trimmed away: the whole rendering closes it
        return rendered
    at = rendered.rfind(core)
    return rendered[at + len(core) :] if at >= 0 else None
