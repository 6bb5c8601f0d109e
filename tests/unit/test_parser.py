"""Hermes tool-call parsing: calls and errors in text order; parsing never raises."""

from __future__ import annotations

import pytest

from tailcut.chat.parser import HermesParser, ToolCall, ToolCallError, format_tool_call, get_parser

P = HermesParser(max_call_chars=200)


def test_text_without_calls_is_all_content():
    parsed = P.parse("  The answer is 4.\n#### 4 ")
    assert parsed.items == [] and parsed.content == "The answer is 4.\n#### 4"


def test_several_calls_in_order_with_the_text_around_them_as_content():
    text = (
        "First I check.\n"
        + format_tool_call("calc", {"answer": "4"})
        + "\nthen\n"
        + format_tool_call("echo", {"text": "héllo", "n": [1, 2]})
    )
    parsed = P.parse(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("calc", {"answer": "4"}),
        ("echo", {"text": "héllo", "n": [1, 2]}),
    ]
    assert parsed.errors == []
    assert parsed.content == "First I check.\n\nthen"


def test_compact_block_without_newlines_parses():
    parsed = P.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert parsed.calls == [ToolCall("f", {"a": 1}, '{"name": "f", "arguments": {"a": 1}}')]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"name": "f", "arguments": {"a": 1}', "invalid JSON"),
        ("not json at all", "invalid JSON"),
        ('["f", {}]', "expected a JSON object, got list"),
        ('{"arguments": {}}', "missing 'name'"),
        ('{"name": "", "arguments": {}}', "missing 'name'"),
        ('{"name": 3, "arguments": {}}', "missing 'name'"),
        ('{"name": "f", "arguments": [1, 2]}', "'arguments' must be a JSON object, got list"),
        ('{"name": "f", "arguments": "[1]"}', "'arguments' must be a JSON object, got list"),
        ('{"name": "f", "arguments": "{oops"}', "'arguments' string is not JSON"),
        ('{"name": "f", "arguments": {"x": "' + "y" * 300 + '"}}', "limit is 200"),
        ('{"name": "f", "parameters": {"x": 1}}', "unknown key 'parameters'"),
    ],
)
def test_bad_blocks_become_errors_that_explain_the_format(body, reason):
    parsed = P.parse(f"ok <tool_call>{body}</tool_call> and " + format_tool_call("g", {}))
    assert len(parsed.items) == 2
    error, call = parsed.items
    assert isinstance(error, ToolCallError) and reason in error.reason
    assert isinstance(call, ToolCall) and call.name == "g"  # later calls still parse
    assert reason in error.message() and '"arguments": <args-json-object>' in error.message()


def test_an_error_keeps_the_tool_name_when_it_got_that_far():
    (error,) = P.parse('<tool_call>{"name": "calc", "arguments": 5}</tool_call>').items
    assert isinstance(error, ToolCallError) and error.name == "calc"


def test_arguments_may_be_missing_null_or_a_json_string():
    blocks = [
        '<tool_call>{"name": "a"}</tool_call>',
        '<tool_call>{"name": "b", "arguments": null}</tool_call>',
        '<tool_call>{"name": "c", "arguments": "{\\"k\\": 1}"}</tool_call>',
        '<tool_call>{"name": "d", "arguments": ""}</tool_call>',
    ]
    parsed = P.parse("".join(blocks))
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("a", {}),
        ("b", {}),
        ("c", {"k": 1}),
        ("d", {}),
    ]


def test_an_unterminated_block_is_an_error_and_not_content():
    parsed = P.parse(format_tool_call("a", {}) + ' text <tool_call>{"name": "b", "argu')
    assert [c.name for c in parsed.calls] == ["a"]
    (error,) = parsed.errors
    assert "not closed" in error.reason
    assert parsed.content == "text"


def test_a_closing_tag_inside_a_json_string_does_not_end_the_call():
    code = {"code": "print('</tool_call>')"}
    text = "Run it.\n" + format_tool_call("python", code) + "\nthen " + format_tool_call("g", {})
    parsed = P.parse(text)
    assert parsed.errors == []
    assert [(c.name, c.arguments) for c in parsed.calls] == [("python", code), ("g", {})]
    assert parsed.content == "Run it.\n\nthen"


def test_a_call_cut_after_a_closing_tag_in_a_string_is_not_closed():
    parsed = P.parse('ok <tool_call>{"name": "python", "arguments": {"code": "</tool_call>"}}')
    (error,) = parsed.items
    assert isinstance(error, ToolCallError) and "not closed" in error.reason
    assert parsed.content == "ok"


def test_get_parser_by_name_and_unknown_names_are_refused():
    assert isinstance(get_parser("hermes", max_call_chars=10), HermesParser)
    with pytest.raises(ValueError, match="unknown tool parser 'qwen9'; known: hermes"):
        get_parser("qwen9")
