"""The ChatML / hermes chat template rendered through the tokenizer's own machinery."""

from __future__ import annotations

from tailcut.chat.parser import HermesParser, format_tool_call
from tailcut.chat.template import (
    CHAT_TEMPLATE,
    DEFAULT_SYSTEM_PROMPT,
    decode,
    encode,
    render,
    render_ids,
    stop_token_ids,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc_gsm8k_reward",
            "description": "Check an answer.",
            "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}},
]


def test_tokenizer_fixture_carries_the_template_and_single_token_tags(chat_tokenizer):
    assert chat_tokenizer.chat_template == CHAT_TEMPLATE
    for tag in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_response>"):
        assert len(encode(chat_tokenizer, tag)) == 1, tag
    text = "Natalia sold 48 clips 🍎 <tool_call>\n{}\n</tool_call>"
    assert decode(chat_tokenizer, encode(chat_tokenizer, text)) == text


def test_default_system_prompt_user_turn_and_generation_prompt(chat_tokenizer):
    text = render(chat_tokenizer, [{"role": "user", "content": "Hi?"}], add_generation_prompt=True)
    assert text == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_are_listed_one_json_schema_a_line_in_the_system_block(chat_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}]
    text = render(chat_tokenizer, messages, TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    lines = system.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert len(lines) == 2
    assert '"name": "calc_gsm8k_reward"' in lines[0] and '"name": "echo"' in lines[1]
    assert '<tool_call>\n{"name": <function-name>' in system
    assert "<tools>" not in render(chat_tokenizer, messages)


def test_tool_messages_of_a_turn_share_one_user_block(chat_tokenizer):
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": "r1"},
        {"role": "tool", "content": "r2"},
    ]
    text = render(chat_tokenizer, messages, add_generation_prompt=True)
    assert text.endswith(
        "<|im_start|>assistant\ncalling<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n"
        "<tool_response>\nr2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_structured_tool_calls_render_as_the_model_writes_them(chat_tokenizer):
    """An assistant message with OpenAI-style tool_calls renders exactly like the raw text
    a model produces in hermes format, so both forms give the same tokens."""
    call = format_tool_call("calc_gsm8k_reward", {"answer": "72"})
    raw = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": f"Sure.\n{call}"}]
    structured = [
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}},
                }
            ],
        },
    ]
    as_string_args = [
        raw[0],
        {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [
                {"function": {"name": "calc_gsm8k_reward", "arguments": '{"answer": "72"}'}}
            ],
        },
    ]
    assert render(chat_tokenizer, raw) == render(chat_tokenizer, structured)
    assert render(chat_tokenizer, raw) == render(chat_tokenizer, as_string_args)
    parsed = HermesParser().parse(raw[1]["content"])
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("calc_gsm8k_reward", {"answer": "72"})
    ]


def test_render_ids_adds_no_bos_and_stop_ids_are_end_of_turn_tokens(chat_tokenizer):
    ids = render_ids(chat_tokenizer, [{"role": "user", "content": "x"}])
    assert ids[0] == chat_tokenizer.convert_tokens_to_ids("<|im_start|>")
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    eot = chat_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert set(stop_token_ids(chat_tokenizer)) == {im_end, eot}
