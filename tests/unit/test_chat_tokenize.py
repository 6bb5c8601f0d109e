"""Incremental tokenization: deltas, forced tokens, prefix-stability errors, alignment."""

from __future__ import annotations

import math
from array import array

import pytest

from tailcut.chat.parser import format_tool_call
from tailcut.chat.template import CHAT_TEMPLATE, decode, encode, render, render_ids
from tailcut.chat.tokenize import (
    IncrementalChat,
    TemplateError,
    append_forced,
    append_sampled,
)
from tailcut.types import Sample

PROMPT = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "2+2?"}]


def _ids(tok, text: str) -> list[int]:
    return encode(tok, text)


def test_prompt_is_rendered_once_with_the_generation_prompt(chat_tokenizer):
    chat = IncrementalChat(chat_tokenizer, PROMPT)
    assert chat.prompt_ids == render_ids(chat_tokenizer, PROMPT, add_generation_prompt=True)
    assert decode(chat_tokenizer, chat.prompt_ids).endswith("<|im_start|>assistant\n")


def test_tool_delta_closes_the_turn_and_opens_the_next_one(chat_tokenizer):
    tok = chat_tokenizer
    chat = IncrementalChat(tok, PROMPT)
    sampled = _ids(tok, "Let me check.\n" + format_tool_call("calc", {"x": 4}) + "<|im_end|>")
    content = chat.add_assistant(sampled)
    assert content == "Let me check.\n" + format_tool_call("calc", {"x": 4})
    assert chat.pending_text == "\n"  # <|im_end|> was sampled; the newline is forced
    forced = chat.add_messages(
        [{"role": "tool", "content": "4"}, {"role": "tool", "content": "ok"}]
    )
    assert decode(tok, forced) == (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n"
        "<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    ids = chat.prompt_ids + sampled + forced
    assert ids == render_ids(tok, chat.messages, add_generation_prompt=True)


def test_end_of_turn_is_forced_when_the_model_stopped_without_it(chat_tokenizer):
    tok = chat_tokenizer
    chat = IncrementalChat(tok, PROMPT)
    chat.add_assistant(_ids(tok, format_tool_call("calc", {})))  # e.g. a stop string
    assert chat.pending_text == "<|im_end|>\n"
    forced = chat.add_messages([{"role": "user", "content": "go on"}])
    assert forced[0] == tok.convert_tokens_to_ids("<|im_end|>")


def test_a_foreign_end_token_is_kept_and_the_template_closing_still_forced(chat_tokenizer):
    tok = chat_tokenizer
    chat = IncrementalChat(tok, PROMPT)
    content = chat.add_assistant(_ids(tok, "4<|endoftext|>"))
    assert content == "4"
    assert chat.pending_text == "<|im_end|>\n"


def test_adding_tool_messages_one_by_one_is_reported_as_not_prefix_stable(chat_tokenizer):
    tok = chat_tokenizer
    chat = IncrementalChat(tok, PROMPT)
    chat.add_assistant(_ids(tok, "two calls<|im_end|>"))
    chat.add_messages([{"role": "tool", "content": "r1"}])
    with pytest.raises(TemplateError, match=r"message 4 \(role 'tool'\).*together"):
        chat.add_messages([{"role": "tool", "content": "r2"}])
    assert len(chat.messages) == 4  # the offending message was not kept


def test_a_template_that_rewrites_history_is_drift_or_rejected_naming_the_message(
    chat_tokenizer,
):
    counting = CHAT_TEMPLATE.replace(
        "{{- '<|im_start|>system\\n' + system_prompt -}}",
        "{{- '<|im_start|>system\\n' + system_prompt + ' (' + (messages | length | string) + ')' -}}",
    )
    assert counting != CHAT_TEMPLATE
    kwargs = {"chat_template": counting}
    strict = IncrementalChat(chat_tokenizer, PROMPT, template_kwargs=kwargs, strict=True)
    with pytest.raises(
        TemplateError, match=r"not prefix-stable: adding message 2 \(role 'assistant'\)"
    ):
        strict.add_assistant(_ids(chat_tokenizer, "4<|im_end|>"))
    assert len(strict.messages) == 2
    # Lenient (the agent loop's way): the sampled tokens stand, the rewrite is recorded,
    # and a template that rewrites the history again on the next messages is refused.
    chat = IncrementalChat(chat_tokenizer, PROMPT, template_kwargs=kwargs)
    assert chat.add_assistant(_ids(chat_tokenizer, "4<|im_end|>")) == "4"
    assert [(d.message, d.kind) for d in chat.drift] == [(2, "history")]
    assert chat.pending_text == "\n"
    with pytest.raises(TemplateError, match=r"adding message 3 \(role 'tool'\)"):
        chat.add_messages([{"role": "tool", "content": "4"}])


def test_a_trimming_template_keeps_the_sampled_spaces_and_records_the_drift(chat_tokenizer):
    trimming = CHAT_TEMPLATE.replace(
        "{{- message.content -}}{%- endif -%}{%- for call",
        "{{- message.content | trim -}}{%- endif -%}{%- for call",
    )
    assert trimming != CHAT_TEMPLATE
    kwargs = {"chat_template": trimming}
    strict = IncrementalChat(chat_tokenizer, PROMPT, template_kwargs=kwargs, strict=True)
    with pytest.raises(TemplateError, match=r"message 2 \(role 'assistant'\) verbatim"):
        strict.add_assistant(_ids(chat_tokenizer, "4   <|im_end|>"))
    chat = IncrementalChat(chat_tokenizer, PROMPT, template_kwargs=kwargs)
    sampled = _ids(chat_tokenizer, "4   <|im_end|>")
    assert chat.add_assistant(sampled) == "4   "
    assert [(d.message, d.kind) for d in chat.drift] == [(2, "assistant")]
    forced = chat.add_messages([{"role": "user", "content": "sure?"}])
    assert (
        decode(chat_tokenizer, forced)
        == "\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n"
    )
    # The template's own view: the spaces trimmed away, all else the same.
    rendered = render(chat_tokenizer, chat.messages, add_generation_prompt=True, **kwargs)
    assert rendered == decode(chat_tokenizer, chat.prompt_ids + sampled + forced).replace(
        "4   <|im_end|>", "4<|im_end|>"
    )


def test_a_template_that_rewrites_a_cut_message_cannot_be_followed(chat_tokenizer):
    shouting = CHAT_TEMPLATE.replace(
        "{{- message.content -}}{%- endif -%}{%- for call",
        "{{- message.content | upper -}}{%- endif -%}{%- for call",
    )
    chat = IncrementalChat(chat_tokenizer, PROMPT, template_kwargs={"chat_template": shouting})
    with pytest.raises(TemplateError, match="cannot be told apart"):
        chat.add_assistant(_ids(chat_tokenizer, "four"))  # cut: no end-of-turn token
    assert len(chat.messages) == 2


def test_two_assistant_messages_in_a_row_need_a_new_turn_in_between(chat_tokenizer):
    tok = chat_tokenizer
    chat = IncrementalChat(tok, PROMPT)
    first = _ids(tok, "4<|im_end|>")
    chat.add_assistant(first)
    with pytest.raises(TemplateError, match="two assistant messages"):
        chat.add_assistant(first)
    forced = chat.add_messages([])
    assert decode(tok, forced) == "\n<|im_start|>assistant\n"


def test_sample_columns_stay_aligned_and_forced_tokens_are_inert():
    sample = Sample(index=3)
    append_sampled(sample, [5, 6], [-0.5, -0.25], version=7)
    append_forced(sample, [1, 2, 3])
    append_sampled(sample, [9], None, version=8)
    assert list(sample.response_ids) == [5, 6, 1, 2, 3, 9]
    assert list(sample.loss_mask) == [1, 1, 0, 0, 0, 1]
    assert list(sample.logprobs[:5]) == [-0.5, -0.25, 0.0, 0.0, 0.0]
    assert math.isnan(sample.logprobs[5])  # missing from the engine: NaN, never 0
    assert list(sample.versions) == [7, 7, -1, -1, -1, 8]
    with pytest.raises(ValueError, match="sample 3: 2 sampled tokens but 1 log-probs"):
        append_sampled(sample, [1, 2], [-1.0], version=0)


def test_engine_arrays_of_any_kind_are_taken():
    """An engine may answer with arrays of another item type (64-bit ids, float32
    log-probs) than the sample's columns; they are converted, not refused."""
    sample = Sample(index=0)
    append_sampled(sample, array("q", [2**31 - 1, 4]), array("f", [-0.5, -2.0]), version=1)
    append_sampled(sample, array("i", [6]), array("d", [-0.125]), version=1)
    assert list(sample.response_ids) == [2**31 - 1, 4, 6]
    assert list(sample.logprobs) == [-0.5, -2.0, -0.125]
    assert sample.response_ids.typecode == "i"


def test_an_empty_conversation_is_refused(chat_tokenizer):
    with pytest.raises(ValueError, match="at least one message"):
        IncrementalChat(chat_tokenizer, [])
