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
is what training needs.

Layout in a :class:`~tailcut.types.Sample`: ``response_ids`` / ``loss_mask`` / ``logprobs``
/ ``versions`` stay the same length; forced tokens have mask 0, logprob 0.0, version -1; a
sampled token whose log-prob the engine did not return has NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tailcut.chat.template import ChatTokenizer, decode, encode, render, stop_token_ids
from tailcut.types import Sample, extend_array


class TemplateError(ValueError):
    """The chat template cannot be used incrementally (it is not prefix-stable)."""


def _divergence(old: str, new: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), len(new))
    return (
        f"at character {at}: the earlier rendering continues {old[at : at + 40]!r}, "
        f"the new one {new[at : at + 40]!r}"
    )


def _describe(index: int, message: Mapping[str, Any]) -> str:
    return f"message {index} (role {message.get('role')!r})"


class IncrementalChat:
    """One conversation's messages and token ids, grown turn by turn.

    ``prompt_ids`` is the rendered prompt. :meth:`add_assistant` records sampled tokens as
    the next assistant message; :meth:`add_messages` returns the forced ids that follow
    (closing of the assistant message, the new messages, the next generation prompt).
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        stop_ids: Iterable[int] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not messages:
            raise ValueError("a conversation needs at least one message")
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] if tools else None
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages]
        self.stop_ids = frozenset(stop_token_ids(tokenizer) if stop_ids is None else stop_ids)
        self._kwargs = dict(template_kwargs or {})
        self._text = self._render(add_generation_prompt=True)
        """The rendered text the ids so far stand for, up to ``_pending`` that is not yet
        in the ids."""
        self._pending = ""
        """Template text closing the last assistant message, not sampled by the model."""
        self.prompt_ids = encode(tokenizer, self._text)

    def _render(self, *, add_generation_prompt: bool) -> str:
        return render(
            self.tokenizer,
            self.messages,
            self.tools,
            add_generation_prompt=add_generation_prompt,
            **self._kwargs,
        )

    def split_stop(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """``token_ids`` as (content, trailing stop token or nothing)."""
        ids = list(token_ids)
        if ids and ids[-1] in self.stop_ids:
            return ids[:-1], ids[-1:]
        return ids, []

    def add_assistant(self, token_ids: Sequence[int]) -> str:
        """Record sampled tokens as the next assistant message; return its content text
        (the decoded tokens, without a trailing end-of-turn token)."""
        if self._pending:
            raise TemplateError(
                "two assistant messages in a row: add the messages between them first "
                "(add_messages([]) opens a new assistant turn)"
            )
        body, stop = self.split_stop(token_ids)
        content = decode(self.tokenizer, body)
        index = len(self.messages)
        self.messages.append({"role": "assistant", "content": content})
        full = self._render(add_generation_prompt=False)
        if not full.startswith(self._text):
            message = self.messages.pop()
            raise TemplateError(
                f"chat template is not prefix-stable: adding {_describe(index, message)} "
                f"changed the text of earlier messages {_divergence(self._text, full)}"
            )
        rendered = full[len(self._text) :]
        if not rendered.startswith(content):
            self.messages.pop()
            raise TemplateError(
                f"chat template does not render message {index} (role 'assistant') verbatim: "
                f"sampled {content[:60]!r}…, rendered {rendered[:60]!r}…; the tokens that "
                "close the message cannot be told apart"
            )
        closing = rendered[len(content) :]
        sampled_end = decode(self.tokenizer, stop) if stop else ""
        if sampled_end and closing.startswith(sampled_end):
            closing = closing[len(sampled_end) :]
        self._pending = closing
        self._text = full
        return content

    def add_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Append tool / user messages (all of one turn at once) and return the forced ids:
        the rest of the last assistant message, the new messages, the generation prompt."""
        start = len(self.messages)
        self.messages.extend(dict(m) for m in messages)
        full = self._render(add_generation_prompt=True)
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
        self._text = full
        return encode(self.tokenizer, forced)

    @property
    def pending_text(self) -> str:
        """Template text that would close the last assistant message (empty otherwise)."""
        return self._pending


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
