"""Incremental tokenization of a conversation, with loss masks.

A trajectory's token ids are built once, in order, and never re-tokenized:

* the prompt (system, user, tool schemas) is rendered with the chat template and tokenized
  once, generation prompt included;
* each assistant turn appends the tokens the engine sampled, exactly as sampled
  (loss mask 1);
* each batch of tool / user messages appends only its *delta*: the conversation is rendered
  before and after the new messages, the new rendering must extend the old one (the
  template is *prefix-stable*), and the extra text is tokenized on its own (loss mask 0).
  The delta starts with whatever the template puts after the sampled tokens to close the
  assistant message (``\\n`` after ``<|im_end|>`` in ChatML, or ``<|im_end|>\\n`` when the
  model stopped without it) and ends with the next generation prompt
  (``<|im_start|>assistant\\n``); these template-forced tokens are masked out too.

When the sampled tokens are the canonical tokenization of the assistant text, the ids
equal a full re-render of the same conversation (tested). When they are not (a model may
sample a non-canonical split), the ids are still the ones the policy saw and sampled, which
is what training needs. The same holds where the template renders an assistant message
otherwise than it was sampled (Llama 3.x trims it, Mistral adds call ids the model may not
have written, Mistral v3 drops the system prompt from the history): the sampled tokens stay,
the message's closing is found after the sampled end-of-turn token (or after its content),
the following turns are rendered by the template, and the difference is recorded in
``IncrementalChat.drift`` (:mod:`tailcut.chat.history`; ``strict=True`` raises instead).

Layout in a :class:`~tailcut.types.Sample`: ``response_ids`` / ``loss_mask`` / ``logprobs``
/ ``versions`` stay the same length; forced tokens have mask 0, logprob 0.0, version -1; a
sampled token whose log-prob the engine did not return has NaN.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from jinja2 import TemplateError as JinjaError

from tailcut.chat.history import (
    Drift,
    answer_ids,
    closing_text,
    structured_message,
    wants_structure,
)
from tailcut.chat.parser import detect_tool_parser, get_parser
from tailcut.chat.template import ChatTokenizer, decode, encode, render, stop_token_ids
from tailcut.chat.tool_calls import ToolParser
from tailcut.types import Sample, extend_array


class TemplateError(ValueError):
    """The chat template cannot be used incrementally (it is not prefix-stable), or it
    refused the conversation."""


def _divergence(
    old: str, new: str, names: tuple[str, str] = ("earlier rendering", "new one")
) -> str:
    at = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), len(new))
    return (
        f"at character {at}: the {names[0]} continues {old[at : at + 40]!r}, "
        f"the {names[1]} {new[at : at + 40]!r}"
    )


def _describe(index: int, message: Mapping[str, Any]) -> str:
    return f"message {index} (role {message.get('role')!r})"


def _template_parser(tokenizer: ChatTokenizer, kwargs: Mapping[str, Any]) -> ToolParser | None:
    """The parser of the tool-call format the chat template names (None: it names none)."""
    template = kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None)
    name = detect_tool_parser(template if isinstance(template, str) else None)
    return get_parser(name) if name else None


class IncrementalChat:
    """One conversation's messages and token ids, grown turn by turn.

    ``prompt_ids`` is the rendered prompt. :meth:`add_assistant` records sampled tokens as
    the next assistant message; :meth:`add_messages` returns the forced ids that follow
    (closing of the assistant message, the new messages, the next generation prompt).

    ``parser``: the tool-call format, which picks the form assistant messages take
    (:mod:`tailcut.chat.history`; default: the format the template names). Where the
    template renders an assistant turn otherwise than it was sampled, the difference is
    recorded in :attr:`drift` (``strict``: raised as a :class:`TemplateError` instead).
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        stop_ids: Iterable[int] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        parser: ToolParser | None = None,
        strict: bool = False,
    ) -> None:
        if not messages:
            raise ValueError("a conversation needs at least one message")
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] if tools else None
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages]
        self.stop_ids = frozenset(stop_token_ids(tokenizer) if stop_ids is None else stop_ids)
        self._kwargs = dict(template_kwargs or {})
        self.parser = parser if parser is not None else _template_parser(tokenizer, self._kwargs)
        self.strict = strict
        self.drift: list[Drift] = []
        """Where the kept tokens and the template's rendering differ (module
        :mod:`tailcut.chat.history`)."""
        self._text = self._render(add_generation_prompt=True)
        """The template's rendering of the conversation so far; the ids stand for it up to
        ``_pending`` (not yet in the ids) and the recorded :attr:`drift`."""
        self.call_seed = _prompt_key(self.messages)
        """What generated call ids derive from (with the message's index): the prompt
        messages, so a conversation rebuilt from its history (a resumed one) gets the same."""
        self._pending = ""
        """Template text closing the last assistant message, not sampled by the model."""
        self._open = False
        """An assistant message was added and the messages after it were not."""
        self._call_ids: list[str] = []
        """Call ids of the last assistant message (structured form), for its tool messages."""
        self.prompt_ids = encode(tokenizer, self._text)

    def _render(self, *, add_generation_prompt: bool) -> str:
        try:
            return render(
                self.tokenizer,
                self.messages,
                self.tools,
                add_generation_prompt=add_generation_prompt,
                **self._kwargs,
            )
        except JinjaError as exc:
            last = len(self.messages) - 1
            raise TemplateError(
                f"chat template refused the conversation up to "
                f"{_describe(last, self.messages[last])}: {exc}"
            ) from exc

    def split_stop(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """``token_ids`` as (content, trailing stop token or nothing)."""
        ids = list(token_ids)
        if ids and ids[-1] in self.stop_ids:
            return ids[:-1], ids[-1:]
        return ids, []

    def _assistant_message(self, content: str, index: int, complete: bool) -> dict[str, Any]:
        # A turn cut short (no end-of-turn token) stays text: its calls are unfinished and
        # no tool message answers it (a resumed trajectory replaces it).
        if not (complete and wants_structure(self.parser)):
            self._call_ids = []
            return {"role": "assistant", "content": content}
        assert self.parser is not None
        parsed = self.parser.parse(content)
        if not parsed.items:  # a plain answer keeps its text as sampled
            self._call_ids = []
            return {"role": "assistant", "content": content}
        message, self._call_ids = structured_message(parsed, f"{index}:{self.call_seed}")
        return message

    def add_assistant(self, token_ids: Sequence[int]) -> str:
        """Record sampled tokens as the next assistant message; return its content text
        (the decoded tokens, without a trailing end-of-turn token)."""
        if self._open:
            raise TemplateError(
                "two assistant messages in a row: add the messages between them first "
                "(add_messages([]) opens a new assistant turn)"
            )
        body, stop = self.split_stop(token_ids)
        content = decode(self.tokenizer, body)
        stop_text = decode(self.tokenizer, stop) if stop else ""
        index = len(self.messages)
        self.messages.append(self._assistant_message(content, index, bool(stop)))
        try:
            full = self._render(add_generation_prompt=False)
        except TemplateError:
            self.messages.pop()
            raise
        stable = full.startswith(self._text)
        rendered = full[len(self._text) :] if stable else full
        closing = closing_text(rendered, content, stop_text)
        if closing is None:
            self.messages.pop()
            raise TemplateError(
                f"chat template does not render message {index} (role 'assistant') verbatim: "
                f"sampled {content[:60]!r}…, rendered {rendered[-120:]!r}; the tokens that "
                "close the message cannot be told apart"
            )
        if not stable:
            self._drifted(
                index,
                "history",
                f"chat template is not prefix-stable: adding {_describe(index, self.messages[-1])}"
                f" changed the text of earlier messages {_divergence(self._text, full)}",
            )
        elif rendered != content + stop_text + closing:
            self._drifted(
                index,
                "assistant",
                f"chat template does not render message {index} (role 'assistant') verbatim "
                + _divergence(content + stop_text + closing, rendered, ("sampled", "rendered")),
            )
        self._pending = closing
        self._text = full
        self._open = True
        return content

    def _drifted(self, index: int, kind: Literal["assistant", "history"], detail: str) -> None:
        if self.strict:
            self.messages.pop()
            raise TemplateError(detail)
        self.drift.append(Drift(index, kind, detail))
        if kind not in _WARNED:
            _WARNED.add(kind)
            _log.warning(
                "%s; the sampled tokens are kept as they are, later turns are rendered by the "
                "template (tailcut.chat.history; warned once)",
                detail,
            )

    def add_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Append tool / user messages (all of one turn at once) and return the forced ids:
        the rest of the last assistant message, the new messages, the generation prompt.
        Tool messages get the call ids of a structured assistant message they answer."""
        start = len(self.messages)
        new = [dict(m) for m in messages]
        answer_ids(new, self._call_ids)
        self.messages.extend(new)
        try:
            full = self._render(add_generation_prompt=True)
        except TemplateError:
            del self.messages[start:]
            raise
        if not full.startswith(self._text):
            named = ", ".join(_describe(start + i, m) for i, m in enumerate(self.messages[start:]))
            del self.messages[start:]
            raise TemplateError(
                f"chat template is not prefix-stable: adding {named or 'a generation prompt'} "
                f"changed the text of earlier messages {_divergence(self._text, full)}"
                " (tool messages of one turn must be added together)"
            )
        forced = self._pending + full[len(self._text) :]
        self._pending = ""
        self._open = False
        self._call_ids = []
        self._text = full
        return encode(self.tokenizer, forced)

    @property
    def pending_text(self) -> str:
        """Template text that would close the last assistant message (empty otherwise)."""
        return self._pending


def _prompt_key(messages: Sequence[Mapping[str, Any]]) -> str:
    """The messages before the first assistant message, as canonical JSON."""
    end = next((k for k, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return json.dumps(list(messages[:end]), sort_keys=True, ensure_ascii=False, default=str)


_WARNED: set[str] = set()
_log = logging.getLogger(__name__)


def append_sampled(
    sample: Sample, token_ids: Sequence[int], logprobs: Sequence[float] | None, version: int
) -> None:
    """Append tokens the policy sampled (mask 1) with their log-probs and weight version
    (``logprobs`` None: the engine returned none; they are recorded as NaN, never as 0)."""
    if logprobs is not None and len(logprobs) != len(token_ids):
        raise ValueError(
            f"sample {sample.index}: {len(token_ids)} sampled tokens but {len(logprobs)} log-probs"
        )
    extend_array(sample.response_ids, token_ids)
    sample.loss_mask.extend([1] * len(token_ids))
    extend_array(sample.logprobs, logprobs if logprobs is not None else [math.nan] * len(token_ids))
    sample.versions.extend([version] * len(token_ids))


def append_forced(sample: Sample, token_ids: Sequence[int]) -> None:
    """Append tokens the policy did not sample (tool output, template-forced; mask 0)."""
    n = len(token_ids)
    sample.response_ids.extend(token_ids)
    sample.loss_mask.extend([0] * n)
    sample.logprobs.extend([0.0] * n)
    sample.versions.extend([-1] * n)
