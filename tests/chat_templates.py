"""Chat templates of the families users train, as test fixtures, and small tokenizers for them.

The Llama and Mistral templates are written here to reproduce what the published templates
*do* (their output, their checks and their quirks), not copied from them:

``LLAMA31_TEMPLATE`` (Llama 3.1 / 3.3 Instruct, custom tools):
  * ``bos_token``, then a system block that always carries the knowledge / today dates
    (``date_string``, default ``26 Jul 2024``) and ``Environment: ipython`` when tools are
    given; the system message is trimmed;
  * tools go into the first user message by default (``tools_in_user_message``), each schema
    as JSON indented by 4, with the ``"parameters"`` call instruction; with
    ``tools_in_user_message=False`` they go into the system block;
  * every user / system / assistant content is **trimmed**;
  * a structured ``tool_calls`` message (one call only, else an error) is rendered as
    ``{"name": ..., "parameters": ...}``;
  * ``tool`` / ``ipython`` messages are an ``ipython`` turn whose content goes through
    ``tojson`` (a string is iterable in Jinja, so a plain string result comes out quoted);
  * the generation prompt is the assistant header.

``MISTRAL_V3_TEMPLATE`` (Mistral-7B-Instruct-v0.3 and the v3 tokenizers):
  * user and plain assistant messages must alternate after the optional system message
    (tool messages and assistant messages with ``tool_calls`` are not counted), else an error;
  * the system message is put in front of the last user message *only while that message
    is the last one* (once the assistant answers, the history renders without it);
  * ``[AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS]`` in front of the last user message;
  * ``[INST] content[/INST]``; an assistant message is ``" " + content|trim + eos``;
  * ``tool_calls`` are ``[TOOL_CALLS] [{"name": ..., "arguments": ..., "id": ...}]`` + eos, and
    every call id and ``tool_call_id`` must be 9 characters, else an error;
  * a tool result is ``[TOOL_RESULTS] {"content": <content as is>, "call_id": ...}[/TOOL_RESULTS]``
    (the content is not JSON-quoted);
  * there is no generation prompt (the model answers right after ``[/INST]`` or
    ``[/TOOL_RESULTS]``).
"""

from __future__ import annotations

from typing import Any

from tailcut.chat.template import CHAT_TEMPLATE

_LLAMA_CALL_FORMAT = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument '
    "name and its value}.Do not use variables.\\n\\n"
)

LLAMA31_TEMPLATE = (
    """{{- bos_token -}}
{%- set tool_list = custom_tools if custom_tools is defined else (tools if tools is defined else none) -%}
{%- set in_user = tools_in_user_message if tools_in_user_message is defined else true -%}
{%- set today = date_string if date_string is defined else '26 Jul 2024' -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set sys_text = messages[0].content | trim -%}{%- set turns = messages[1:] -%}
{%- else -%}
  {%- set sys_text = '' -%}{%- set turns = messages -%}
{%- endif -%}
<|start_header_id|>system<|end_header_id|>{{ '\\n\\n' }}
{%- if tool_list is not none -%}Environment: ipython{{ '\\n' }}{%- endif -%}
Cutting Knowledge Date: December 2023{{ '\\n' }}Today Date: {{ today }}{{ '\\n\\n' }}
{%- if tool_list is not none and not in_user -%}
  {{- 'You have access to the following functions. To call a function, please respond with '
      'JSON for a function call.' -}}
  {{- '"""
    + _LLAMA_CALL_FORMAT
    + """' -}}
  {%- for t in tool_list -%}{{- t | tojson(indent=4) -}}{{- '\\n\\n' -}}{%- endfor -%}
{%- endif -%}
{{- sys_text -}}<|eot_id|>
{%- if tool_list is not none and in_user -%}
  {%- if not turns -%}{{- raise_exception('Cannot put tools in the first user message when '
      'there is no first user message!') -}}{%- endif -%}
  <|start_header_id|>user<|end_header_id|>{{ '\\n\\n' }}
  {{- 'Given the following functions, please respond with a JSON for a function call with '
      'its proper arguments that best answers the given prompt.\\n\\n' -}}
  {{- '"""
    + _LLAMA_CALL_FORMAT
    + """' -}}
  {%- for t in tool_list -%}{{- t | tojson(indent=4) -}}{{- '\\n\\n' -}}{%- endfor -%}
  {{- turns[0].content | trim -}}<|eot_id|>
  {%- set turns = turns[1:] -%}
{%- endif -%}
{%- for m in turns -%}
  {%- if m.role in ['tool', 'ipython'] -%}
    <|start_header_id|>ipython<|end_header_id|>{{ '\\n\\n' }}
    {%- if m.content is mapping or m.content is iterable -%}{{- m.content | tojson -}}
    {%- else -%}{{- m.content -}}{%- endif -%}<|eot_id|>
  {%- elif 'tool_calls' in m -%}
    {%- if m.tool_calls | length != 1 -%}
      {{- raise_exception('This model only supports single tool-calls at once!') -}}
    {%- endif -%}
    {%- set fn = m.tool_calls[0].function -%}
    <|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}
    {{- '{"name": "' + fn.name + '", "parameters": ' + (fn.arguments | tojson) + '}' -}}
    <|eot_id|>
  {%- else -%}
    <|start_header_id|>{{ m.role }}<|end_header_id|>{{ '\\n\\n' }}
    {{- m.content | trim -}}<|eot_id|>
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}
{%- endif -%}"""
)
"""Llama 3.1's chat template behaviour (module docstring)."""

MISTRAL_V3_TEMPLATE = """{%- if messages and messages[0].role == 'system' -%}
  {%- set sys_text = messages[0].content -%}{%- set turns = messages[1:] -%}
{%- else -%}
  {%- set sys_text = none -%}{%- set turns = messages -%}
{%- endif -%}
{%- set tool_list = tools if tools is defined else none -%}
{%- set users = turns | selectattr('role', 'equalto', 'user') | list -%}
{%- set state = namespace(n=0) -%}
{%- for m in turns -%}
  {%- if m.role not in ['tool', 'tool_results'] and not (m.tool_calls is defined
        and m.tool_calls is not none) -%}
    {%- if (m.role == 'user') != (state.n % 2 == 0) -%}
      {{- raise_exception('After the optional system message, conversation roles must '
          'alternate user/assistant/user/assistant/...') -}}
    {%- endif -%}
    {%- set state.n = state.n + 1 -%}
  {%- endif -%}
{%- endfor -%}
{{- bos_token -}}
{%- for m in turns -%}
  {%- if m.role == 'user' -%}
    {%- if tool_list is not none and m == users[-1] -%}
      [AVAILABLE_TOOLS] [
      {%- for t in tool_list -%}
        {%- set f = t.function if t.function is defined else t -%}
        {{- '{"type": "function", "function": {' -}}
        {%- for key, value in f.items() if key != 'return' -%}
          {{- '"' + key + '": ' -}}
          {%- if value is string -%}{{- '"' + value + '"' -}}
          {%- else -%}{{- value | tojson -}}{%- endif -%}
          {{- '' if loop.last else ', ' -}}
        {%- endfor -%}
        {{- '}}' + ('' if loop.last else ', ') -}}
      {%- endfor -%}
      ][/AVAILABLE_TOOLS]
    {%- endif -%}
    {%- if loop.last and sys_text is not none -%}
      [INST] {{ sys_text + '\\n\\n' + m.content }}[/INST]
    {%- else -%}
      [INST] {{ m.content }}[/INST]
    {%- endif -%}
  {%- elif m.tool_calls is defined and m.tool_calls is not none -%}
    [TOOL_CALLS] [
    {%- for call in m.tool_calls -%}
      {%- if call.id is not defined or call.id | length != 9 -%}
        {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') -}}
      {%- endif -%}
      {%- set body = call.function | tojson -%}
      {{- body[:-1] + ', "id": "' + call.id + '"}' -}}
      {{- (']' + eos_token) if loop.last else ', ' -}}
    {%- endfor -%}
  {%- elif m.role == 'assistant' -%}
    {{- ' ' + (m.content | trim) + eos_token -}}
  {%- elif m.role in ['tool', 'tool_results'] -%}
    {%- if m.tool_call_id is not defined or m.tool_call_id | length != 9 -%}
      {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') -}}
    {%- endif -%}
    [TOOL_RESULTS] {"content": {{ m.content | string }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]
  {%- else -%}
    {{- raise_exception('Only user and assistant roles are supported, with the exception of '
        'an initial optional system message!') -}}
  {%- endif -%}
{%- endfor -%}"""
"""Mistral v3's chat template behaviour (module docstring)."""

FAMILY_TOKENS: dict[str, dict[str, Any]] = {
    "hermes": {
        "template": CHAT_TEMPLATE,
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        "bos": None,
        "eos": "<|im_end|>",
    },
    "llama3_json": {
        "template": LLAMA31_TEMPLATE,
        "special": [
            "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|eom_id|>", "<|python_tag|>",
        ],
        "added": [],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
    },
    "mistral": {
        "template": MISTRAL_V3_TEMPLATE,
        "special": [
            "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
            "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
        ],
        "added": [],
        "bos": "<s>",
        "eos": "</s>",
    },
}  # fmt: skip
"""Per format: the chat template, control tokens (special), tags (added, not special), BOS
and EOS of a tokenizer of that family."""

_CORPUS = [
    "system user assistant tool calculator expression",
    "What is six times seven? Use the calculator. Answer: 42",
    '{"name": "calculator", "parameters": {"expression": "6 * 7"}, "arguments": "id"}',
]


def family_tokenizer(family: str) -> Any:
    """A small byte-level BPE with the family's control tokens and chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILY_TOKENS[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=spec["special"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    extra = {"bos_token": spec["bos"]} if spec["bos"] else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=spec["eos"],
        chat_template=spec["template"],
        clean_up_tokenization_spaces=False,
        **extra,
    )
