"""Tool-call formats of the families users train: hermes (Qwen), Llama 3.x JSON, Mistral
``[TOOL_CALLS]``. Each parser on its own, then each inside the real agent loop on a chat
template of that family (``chat_templates``: ChatML, Llama 3.1's and Mistral v3's behaviour): well-formed calls run, malformed ones come back to
the model as tool messages (the trajectory goes on, never FAILED)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chat_templates import family_tokenizer
from fakes.scripted_engine import ScriptCall, ScriptedEngine
from tailcut.chat.parser import (
    PARSERS,
    AutoParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
    ToolCallError,
    detect_tool_parser,
    format_tool_call,
    get_parser,
)
from tailcut.chat.parser_llama import format_llama3_call
from tailcut.chat.parser_mistral import format_mistral_call
from tailcut.chat.template import decode
from tailcut.config import AgentLoopConfig
from tailcut.rollout.agent_loop import AgentLoop
from tailcut.tools.base import ToolSet
from tailcut.tools.calculator import CalculatorTool
from tailcut.trace.events import NULL_TRACER
from tailcut.types import FinishReason, Sample
from tailcut.vtime import run_virtual

# -- the parsers ---------------------------------------------------------------------------


def test_config_names_every_parser():
    assert set(get_args(AgentLoopConfig.model_fields["tool_parser"].annotation)) == set(PARSERS)
    for name in PARSERS:
        assert hasattr(get_parser(name, max_call_chars=64), "parse")


def test_llama3_whole_message_call_with_parameters():
    text = format_llama3_call("calculator", {"expression": "6 * 7"})
    parsed = Llama3JsonParser().parse(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("calculator", {"expression": "6 * 7"})
    ]
    assert parsed.content == "" and parsed.errors == []


def test_llama3_python_tag_several_calls_and_content_around_them():
    text = (
        "I will compute both.\n<|python_tag|>"
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": 2}}'
        "\nDone.<|eom_id|>"
    )
    parsed = Llama3JsonParser().parse(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("a", {"x": 1}), ("b", {"y": 2})]
    assert parsed.content == "I will compute both.\nDone."


def test_llama3_plain_text_is_content_not_a_call():
    parsed = Llama3JsonParser().parse("The answer is {x} = 4.\nAnswer: 4")
    assert parsed.items == [] and parsed.content == "The answer is {x} = 4.\nAnswer: 4"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"name": "calculator", "parameters": {"expression": "1"', "invalid JSON"),
        ('{"parameters": {}}', "missing 'name'"),
        ('{"name": "f", "parameters": [1]}', "'parameters' must be a JSON object, got list"),
        ("<|python_tag|>[1]", "expected a JSON object, got int"),
        ('{"name": "f", "parameters": {"x": "' + "y" * 300 + '"}}', "limit is 200"),
    ],
)
def test_llama3_malformed_calls_are_errors_in_llama_terms(text, reason):
    (error,) = Llama3JsonParser(max_call_chars=200).parse(text).items
    assert isinstance(error, ToolCallError) and reason in error.reason
    assert '"parameters": <args-json-object>' in error.message()


def test_mistral_v3_json_list_keeps_ids():
    text = "Let me run it. " + format_mistral_call("calc", {"a": 1}, call_id="a1b2c3d4e")
    parsed = MistralParser().parse(text)
    assert parsed.calls == [
        ToolCall(
            "calc",
            {"a": 1},
            '[{"name": "calc", "arguments": {"a": 1}, "id": "a1b2c3d4e"}]',
            "a1b2c3d4e",
        )
    ]
    assert parsed.content == "Let me run it."


def test_mistral_v3_list_of_two_and_v11_args_layout():
    two = '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": 2}}]'
    assert [c.name for c in MistralParser().parse(two).calls] == ["a", "b"]
    v11 = (
        format_mistral_call("a", {"x": 1}, layout="args")
        + format_mistral_call("b", {"y": 2}, call_id="Z9y8X7w6V", layout="args")
        + " trailing words"
    )
    parsed = MistralParser().parse(v11)
    assert [(c.name, c.arguments, c.id) for c in parsed.calls] == [
        ("a", {"x": 1}, None),
        ("b", {"y": 2}, "Z9y8X7w6V"),
    ]
    assert parsed.content == "trailing words"


@pytest.mark.parametrize(
    ("text", "reason", "hint"),
    [
        ('[TOOL_CALLS][{"name": "a", "arguments": {', "invalid JSON", '[{"name"'),
        ("[TOOL_CALLS][]", "list of calls is empty", '[{"name"'),
        ('[TOOL_CALLS][{"arguments": {}}]', "missing 'name'", '[{"name"'),
        ('[TOOL_CALLS]calc{"a": 1}', "neither by a JSON list", "[ARGS]"),
        ('[TOOL_CALLS]two words[ARGS]{"a": 1}', "bad function name", "[ARGS]"),
        ("[TOOL_CALLS]calc[ARGS]{oops", "arguments: invalid JSON", "[ARGS]"),
        ("[TOOL_CALLS]calc[ARGS][1]", "'arguments' must be a JSON object", "[ARGS]"),
    ],
)
def test_mistral_malformed_calls_are_errors_in_mistral_terms(text, reason, hint):
    parsed = MistralParser().parse(text)
    (error,) = parsed.errors
    assert reason in error.reason and hint in error.message()


def test_a_bad_call_does_not_hide_the_next_one():
    text = '[TOOL_CALLS]calc[ARGS]{oops[TOOL_CALLS]calc[ARGS]{"expression": "1 + 1"}'
    items = MistralParser().parse(text).items
    assert isinstance(items[0], ToolCallError) and isinstance(items[1], ToolCall)


def test_auto_reads_each_turn_by_its_markers():
    auto = AutoParser()
    assert auto.parse(format_tool_call("a", {})).calls[0].name == "a"
    assert auto.parse(format_llama3_call("b", {})).calls[0].name == "b"
    assert auto.parse(format_mistral_call("c", {})).calls[0].name == "c"
    assert auto.parse("Answer: 3").items == []


MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>"]
PIECES = st.one_of(
    st.sampled_from([*MARKERS, "{", "}", "[", "]", '"name"', ":", ",", ";", '"a"', "1", " "]),
    st.text(max_size=6),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=30))
def test_no_parser_ever_raises(pieces):
    text = "".join(pieces)
    for factory in PARSERS.values():
        parsed = factory(max_call_chars=64).parse(text)
        for item in parsed.items:
            assert isinstance(item, ToolCall | ToolCallError)
            if isinstance(item, ToolCallError):
                assert item.message().startswith("Error: could not parse tool call: ")


# -- each format in the agent loop, on a template of that family ---------------------------

FAMILIES: dict[str, dict[str, Any]] = {
    "hermes": {
        "eos": "<|im_end|>", "turn": "<|im_start|>assistant",
        "result": "<tool_response>\n42\n</tool_response>",
        "lead": "Let me compute.\n",
        "bad": '<tool_call>\n{"name": "calculator", "arguments": ["6 * 7"]}\n</tool_call>',
        "good": "Now right.\n" + format_tool_call("calculator", {"expression": "6 * 7"}),
        "hint": "<tool_call>",
    },
    "llama3_json": {
        "eos": "<|eot_id|>", "turn": "<|start_header_id|>assistant<|end_header_id|>",
        "result": '<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|>',
        "lead": "",  # a Llama call is the whole message
        "bad": '{"name": "calculator", "parameters": {"expression": "6 * 7"',
        "good": "<|python_tag|>" + format_llama3_call("calculator", {"expression": "6 * 7"}),
        "hint": '"parameters"',
    },
    "mistral": {
        "eos": "</s>", "turn": "</s>",
        "result": '[TOOL_RESULTS] {"content": 42, "call_id": "a1b2c3d4e"}[/TOOL_RESULTS]',
        "lead": "Let me compute. ",
        "bad": '[TOOL_CALLS]calculator{"expression": "6 * 7"}',
        "good": format_mistral_call("calculator", {"expression": "6 * 7"}, call_id="a1b2c3d4e"),
        "hint": "[TOOL_CALLS]",
    },
}  # fmt: skip
"""Per format (its template and tokenizer: ``chat_templates``): what a turn of the script
says and what the tool result looks like in the prompt."""


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: Any) -> tuple[str, Any]:
    return request.param, family_tokenizer(request.param)


def _script(spec: dict[str, Any], replies: list[str]) -> Callable[[ScriptCall], str]:
    def reply(call: ScriptCall) -> str:
        turn = call.prompt_text.count(spec["turn"]) - (spec["turn"] != spec["eos"])
        return replies[min(max(turn, 0), len(replies) - 1)]

    return reply


def _run(family: str, tok: Any, parser: str) -> tuple[Sample, ScriptedEngine]:
    spec = FAMILIES[family]
    replies = [spec["lead"] + spec["bad"], spec["good"], "Answer: 42"]
    engine = ScriptedEngine(tok, _script(spec, replies), end_token=spec["eos"])
    loop = AgentLoop(
        tok, AgentLoopConfig(tool_parser=parser, max_turns=4),
        toolset=ToolSet({"calculator": CalculatorTool()}), reward_fn=lambda s, r: 1.0,
    )  # fmt: skip
    prompt = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "What is six times seven?"},
    ]
    sample = Sample(index=0, data={"prompt": prompt})
    run_virtual(loop(sample, engine, NULL_TRACER))
    return sample, engine


def test_the_template_names_its_format(family):
    name, tok = family
    assert detect_tool_parser(tok.chat_template) == name
    assert type(get_parser("auto", chat_template=tok.chat_template)) is type(get_parser(name))


@pytest.mark.parametrize("parser", ["own", "auto"])
def test_a_malformed_call_is_a_tool_message_then_the_call_runs(family, parser):
    name, tok = family
    spec = FAMILIES[name]
    sample, engine = _run(name, tok, name if parser == "own" else "auto")
    assert sample.finish_reason is FinishReason.STOP and sample.reward == 1.0
    assert [t.tool_parse_errors for t in sample.turns] == [1, 0, 0]
    assert [t.tool_errors for t in sample.turns] == [1, 0, 0]
    tools = [m for m in sample.messages if m["role"] == "tool"]
    assert tools[0]["content"].startswith("Error: could not parse tool call: ")
    assert spec["hint"] in tools[0]["content"]
    assert {k: v for k, v in tools[1].items() if k != "tool_call_id"} == {
        "role": "tool", "name": "calculator", "content": "42"
    }  # fmt: skip
    # The tool result reached the model in the family's own layout, tokens masked out.
    last_prompt = decode(tok, engine.requests[-1].prompt_ids)
    assert spec["result"] in last_prompt
    sampled = [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if m]
    assert spec["result"] not in decode(tok, sampled)
    assert len(engine.requests) == 3
