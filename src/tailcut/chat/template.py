"""The ChatML chat template (Qwen2.5 / hermes layout) and render helpers.

``CHAT_TEMPLATE`` is a Jinja string meant for ``tokenizer.chat_template``; the built-in
model ships it. Layout it produces::

    <|im_start|>system
    {system prompt}[\\n\\n# Tools ... <tools>{one JSON schema a line}</tools> ...]<|im_end|>
    <|im_start|>user
    {content}<|im_end|>
    <|im_start|>assistant
    {content}[\\n]<tool_call>
    {"name": ..., "arguments": {...}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    {tool message content}
    </tool_response>
    <tool_response>
    {next tool message of the same turn}
    </tool_response><|im_end|>
    <|im_start|>assistant
    {generation starts here}

Consecutive ``tool`` messages share one ``user`` block, so a turn's tool results must be
appended together (appending them one by one is not prefix-stable, and
:mod:`tailcut.chat.tokenize` says so). An assistant message's ``content`` is rendered
verbatim; structured ``tool_calls`` (OpenAI shape, arguments as an object or a JSON string)
are rendered in the hermes form the model is asked to produce.

Rendering always goes through the tokenizer's own ``apply_chat_template``, so any model's
template can be used in place of this one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
EOM_ID = "<|eom_id|>"
"""Llama 3.1+'s end of message: ends an assistant turn after a tool call, as ``<|eot_id|>``
(the tokenizer's EOS) ends any other."""
STANDS_FOR = {EOM_ID: "<|eot_id|>"}
"""A sampled end token that is the format's own end of a message where the template writes
another: the template's is not forced after it. (Any other foreign end token, say ChatML's
``<|endoftext|>``, is kept and the template's closing still forced.)"""
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

SPECIAL_TOKENS: tuple[str, ...] = (END_OF_TEXT, IM_START, IM_END)
"""Control tokens of the layout (special: dropped by ``skip_special_tokens``)."""
TOOL_TAG_TOKENS: tuple[str, ...] = (
    TOOL_CALL_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_RESPONSE_OPEN,
    TOOL_RESPONSE_CLOSE,
)
"""Tags that should be single added tokens (not special: they are part of the text)."""

_TOOLS_PREAMBLE = (
    "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_POSTAMBLE = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
)

CHAT_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set system_prompt = messages[0].content -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_prompt = '" + DEFAULT_SYSTEM_PROMPT + "' -%}{%- set rest = messages -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system_prompt -}}"
    "{%- if tools -%}"
    '{{- "' + _TOOLS_PREAMBLE + '" -}}'
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    '{{- "' + _TOOLS_POSTAMBLE + '" -}}'
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for message in rest -%}"
    "{%- if message.role == 'tool' -%}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.content -%}{{- message.content -}}{%- endif -%}"
    "{%- for call in (message.tool_calls or []) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' -}}'
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}"
    "{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML with hermes tool calling; usable as ``tokenizer.chat_template``."""


class ChatTokenizer(Protocol):
    """What tailcut needs from a (Hugging Face) tokenizer."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, /, *, add_special_tokens: bool = ...) -> Any: ...

    def decode(self, token_ids: Any, /, **kwargs: Any) -> Any: ...

    def convert_tokens_to_ids(self, tokens: Any) -> Any: ...


Message = Mapping[str, Any]


def render(
    tokenizer: ChatTokenizer,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> str:
    """Render ``messages`` (and tool schemas) to text with the tokenizer's own template."""
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
    if not isinstance(text, str):
        raise TypeError(
            f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str; "
            "is the tokenizer's chat_template set?"
        )
    return text


def encode(tokenizer: ChatTokenizer, text: str) -> list[int]:
    """Token ids of rendered text. The template carries its own special tokens, so the
    tokenizer adds none (no extra BOS)."""
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def decode(tokenizer: ChatTokenizer, token_ids: Sequence[int]) -> str:
    """Text of ``token_ids`` exactly as sampled: special tokens kept, no space clean-up."""
    text = tokenizer.decode(
        list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    if not isinstance(text, str):
        raise TypeError(f"tokenizer.decode returned {type(text).__name__}, not str")
    return text


def render_ids(
    tokenizer: ChatTokenizer,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
) -> list[int]:
    """Full render of a conversation, tokenized in one piece (the reference that
    incremental tokenization is tested against)."""
    return encode(
        tokenizer, render(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt)
    )


def stop_token_ids(tokenizer: ChatTokenizer) -> tuple[int, ...]:
    """End-of-turn ids: the tokenizer's EOS (one or several) plus ``<|im_end|>``,
    ``<|endoftext|>`` and Llama's ``<|eom_id|>`` where the vocabulary has them."""
    found: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    for value in eos if isinstance(eos, list | tuple) else [eos]:
        if isinstance(value, int):
            found.append(value)
    unk = getattr(tokenizer, "unk_token_id", None)
    for token in (IM_END, END_OF_TEXT, EOM_ID):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid >= 0 and tid != unk:
            found.append(tid)
    return tuple(dict.fromkeys(found))
