"""Multi-turn tool conversations on Llama 3.1's and Mistral v3's chat templates
(``chat_templates``: their behaviour, trimming and call-id rules included), through the agent
loop: the tokens the engine sampled are kept as they are, every token between them is the
template's rendering, the loss mask covers exactly the sampled tokens, and where the template
renders history otherwise than sampled the difference is recorded, not hidden."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest

from chat_templates import family_tokenizer
from fakes.scripted_engine import ScriptCall, ScriptedEngine
from tailcut.chat.history import call_id
from tailcut.chat.parser import HermesParser
from tailcut.chat.template import decode, encode, render, stop_token_ids
from tailcut.chat.tokenize import IncrementalChat, TemplateError
from tailcut.config import AgentLoopConfig
from tailcut.rollout.agent_loop import AgentLoop
from tailcut.rollout.resume import ResumableAgentLoop
from tailcut.tools.base import ToolResult, ToolSet
from tailcut.tools.calculator import CalculatorTool
from tailcut.trace.events import NULL_TRACER
from tailcut.types import FinishReason, Sample
from tailcut.vtime import run_virtual

USER = {"role": "user", "content": "What is six times seven?"}
SYSTEM = {"role": "system", "content": "Use the calculator."}
CALC = '{"name": "calculator", "arguments": {"expression": "6 * 7"}'


@pytest.fixture(scope="module")
def llama() -> Any:
    return family_tokenizer("llama3_json")


@pytest.fixture(scope="module")
def mistral() -> Any:
    return family_tokenizer("mistral")


def _run(tok: Any, replies: list[str], prompt: list[dict[str, str]], eos: str) -> tuple:
    it = iter(replies)

    def script(call: ScriptCall) -> str:
        return next(it)

    engine = ScriptedEngine(tok, script, end_token=eos)
    toolset = ToolSet({"calculator": CalculatorTool()})
    loop = AgentLoop(tok, AgentLoopConfig(max_turns=4, tool_parser="auto"), toolset=toolset)
    sample = Sample(index=0, data={"prompt": prompt})
    run_virtual(loop(sample, engine, NULL_TRACER))
    return sample, engine, toolset.schemas()


def _runs(sample: Sample, mask: int) -> Iterator[list[int]]:
    """The runs of response tokens whose loss mask is ``mask``, in order."""
    run: list[int] = []
    for tid, m in zip(sample.response_ids, sample.loss_mask, strict=True):
        if m == mask:
            run.append(tid)
        elif run:
            yield run
            run = []
    if run:
        yield run


def _check_mask(sample: Sample, engine: ScriptedEngine) -> None:
    """Mask 1 is exactly what the engine returned, call by call; each call's prompt is the
    trajectory so far (tokens in, tokens out: nothing re-tokenized)."""
    assert list(_runs(sample, 1)) == [list(r.output_ids) for r in engine.results]
    stream = list(sample.prompt_ids) + list(sample.response_ids)
    for request in engine.requests:
        assert stream[: len(request.prompt_ids)] == list(request.prompt_ids)


def _render(tok: Any, messages: list[dict[str, Any]], tools: Any, **kw: Any) -> str:
    return render(tok, messages, tools, **kw)


# -- Llama 3.1 -----------------------------------------------------------------------------


def test_llama_tool_conversation_is_the_templates_rendering_token_for_token(llama):
    call = '{"name": "calculator", "parameters": {"expression": "6 * 7"}}'
    sample, engine, tools = _run(llama, [call, "Answer: 42"], [SYSTEM, USER], "<|eot_id|>")
    assert sample.finish_reason is FinishReason.STOP
    _check_mask(sample, engine)
    stream = list(sample.prompt_ids) + list(sample.response_ids)
    assert stream == encode(llama, _render(llama, sample.messages, tools))
    (forced,) = _runs(sample, 0)
    assert decode(llama, forced) == (
        '<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert sample.messages[2] == {"role": "assistant", "content": call}  # text form


def test_llama_trims_what_the_model_padded_the_stream_keeps_it(llama):
    call = ' {"name": "calculator", "parameters": {"expression": "6 * 7"}}\n'
    sample, engine, tools = _run(llama, [call, "Answer: 42\n\n"], [USER], "<|eot_id|>")
    assert sample.finish_reason is FinishReason.STOP
    _check_mask(sample, engine)
    text = decode(llama, list(sample.prompt_ids) + list(sample.response_ids))
    rendered = _render(llama, sample.messages, tools)
    assert text != rendered
    # The stream is the template's rendering plus exactly the white space it trimmed.
    assert text.replace(call, call.strip()).replace("Answer: 42\n\n", "Answer: 42") == rendered
    # What came between the turns is the template's own text for what follows a message.
    upto = _render(llama, sample.messages[:2], tools)
    nxt = _render(llama, sample.messages[:3], tools, add_generation_prompt=True)
    assert [decode(llama, r) for r in _runs(sample, 0)] == [nxt[len(upto) :]]


def test_llama_eom_after_a_call_ends_the_turn_as_eot_does(llama):
    # Llama 3.1+ ends a call in "ipython" mode with <|eom_id|>: the engine must stop there.
    eot, eom = llama.convert_tokens_to_ids(["<|eot_id|>", "<|eom_id|>"])
    assert set(stop_token_ids(llama)) == {eot, eom}
    call = '{"name": "calculator", "parameters": {"expression": "6 * 7"}}'
    sample, engine, _ = _run(
        llama, [call + "<|eom_id|> and on", "Answer: 42"], [USER], "<|eot_id|>"
    )
    assert [r.output_ids[-1] for r in engine.results] == [eom, eot]
    assert sample.messages[1] == {"role": "assistant", "content": call}
    assert sample.messages[2]["content"] == "42"
    _check_mask(sample, engine)
    # The template closes the call with <|eot_id|>; the sampled <|eom_id|> stands for it
    # (the next turn follows it at once, no <|eot_id|> forced after it).
    stream = decode(llama, list(sample.response_ids))
    assert "<|eom_id|><|start_header_id|>ipython" in stream and "<|eom_id|><|eot_id|>" not in stream


def test_llama_drift_is_recorded_per_message(llama):
    chat = IncrementalChat(llama, [USER])
    chat.add_assistant(encode(llama, "4\n<|eot_id|>"))
    assert [(d.message, d.kind) for d in chat.drift] == [(1, "assistant")]
    assert chat.pending_text == ""  # the model sampled <|eot_id|>; nothing is forced after it
    exact = IncrementalChat(llama, [USER])
    exact.add_assistant(encode(llama, "4<|eot_id|>"))
    assert exact.drift == []


# -- Mistral v3 ----------------------------------------------------------------------------


def test_mistral_calls_with_the_models_ids_are_the_rendering_token_for_token(mistral):
    call = f'[TOOL_CALLS] [{CALC}, "id": "a1b2c3d4e"}}]'
    sample, engine, tools = _run(mistral, [call, " Answer: 42"], [USER], "</s>")
    assert sample.finish_reason is FinishReason.STOP and len(engine.requests) == 2
    _check_mask(sample, engine)
    stream = list(sample.prompt_ids) + list(sample.response_ids)
    assert stream == encode(mistral, _render(mistral, sample.messages, tools))
    assistant, tool = sample.messages[1], sample.messages[2]
    assert assistant["tool_calls"] == [
        {
            "id": "a1b2c3d4e",
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "6 * 7"}},
        }
    ]
    assert tool["tool_call_id"] == "a1b2c3d4e"
    (forced,) = _runs(sample, 0)
    assert decode(mistral, forced) == (
        '[TOOL_RESULTS] {"content": 42, "call_id": "a1b2c3d4e"}[/TOOL_RESULTS]'
    )


def test_mistral_calls_without_ids_get_nine_character_ids_that_the_results_answer(mistral):
    two = f"[TOOL_CALLS] [{CALC}}}, " + CALC.replace("6 * 7", "2 + 3") + "}]"
    replies = [two, " Answer: 42"]
    sample, engine, tools = _run(mistral, replies, [SYSTEM, USER], "</s>")
    assert sample.finish_reason is FinishReason.STOP
    _check_mask(sample, engine)
    ids = [c["id"] for c in sample.messages[2]["tool_calls"]]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids) and len(set(ids)) == 2
    assert [m["tool_call_id"] for m in sample.messages[3:5]] == ids
    (forced,) = _runs(sample, 0)
    assert decode(mistral, forced) == (
        f'[TOOL_RESULTS] {{"content": 42, "call_id": "{ids[0]}"}}[/TOOL_RESULTS]'
        f'[TOOL_RESULTS] {{"content": 5, "call_id": "{ids[1]}"}}[/TOOL_RESULTS]'
    )
    # The same conversation gets the same ids (a seeded rollout is reproducible).
    again, _, _ = _run(mistral, replies, [SYSTEM, USER], "</s>")
    assert [c["id"] for c in again.messages[2]["tool_calls"]] == ids
    # The model saw its system prompt; Mistral v3 drops it from the history once the
    # assistant answers. The stream keeps what the model saw.
    text = decode(mistral, list(sample.prompt_ids) + list(sample.response_ids))
    assert "[INST] Use the calculator.\n\nWhat is six times seven?[/INST]" in text
    assert "Use the calculator." not in _render(mistral, sample.messages, tools)


def test_mistral_drift_names_the_missing_id_and_the_dropped_system_prompt(mistral):
    chat = IncrementalChat(mistral, [SYSTEM, USER])
    chat.add_assistant(encode(mistral, f"[TOOL_CALLS] [{CALC}}}]</s>"))
    assert [(d.message, d.kind) for d in chat.drift] == [(2, "history")]
    chat.add_messages([{"role": "tool", "content": "42"}])
    chat.add_assistant(encode(mistral, f"[TOOL_CALLS] [{CALC}}}]</s>"))
    (_, second) = chat.drift
    assert second.kind == "assistant" and '"id": "' in second.detail
    ident = chat.messages[4]["tool_calls"][0]["id"]
    assert ident == call_id(f"4:{chat.call_seed}", 0)
    # Rebuilt from its history (a resumed trajectory), the conversation draws the same ids.
    rebuilt = IncrementalChat(mistral, chat.messages[:4])
    rebuilt.add_assistant(encode(mistral, f"[TOOL_CALLS] [{CALC}}}]</s>"))
    assert rebuilt.messages[4]["tool_calls"][0]["id"] == ident


def test_a_mistral_turn_cut_inside_its_call_stays_text(mistral):
    """A generation cut short (no ``</s>``) has an unfinished call: it is kept as text (no
    tool message will answer it), and its closing is still found."""
    chat = IncrementalChat(mistral, [USER])
    partial = '[TOOL_CALLS] [{"name": "calculator", "argu'
    assert chat.add_assistant(encode(mistral, partial)) == partial
    assert chat.messages[-1] == {"role": "assistant", "content": partial}
    assert chat.pending_text == "</s>"


def test_mistral_needs_the_structured_form(mistral):
    """In the text form (a hermes parser on Mistral's template), the tool result has no call
    to answer: the template refuses it, and the error names the conversation."""
    chat = IncrementalChat(mistral, [USER], parser=HermesParser())
    chat.add_assistant(encode(mistral, f"[TOOL_CALLS] [{CALC}}}]</s>"))
    with pytest.raises(TemplateError, match=r"refused .* message 2 \(role 'tool'\).*length 9"):
        chat.add_messages([{"role": "tool", "content": "42"}])
    assert len(chat.messages) == 2


class _SlowCalculator(CalculatorTool):
    """The calculator, answering after 5 s of virtual time (so a cut can land in a call)."""

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        await asyncio.sleep(5.0)
        return await super().execute(instance_id, arguments)


def test_a_mistral_trajectory_cut_inside_its_call_resumes_to_the_uncut_stream(mistral):
    replies = [f"[TOOL_CALLS] [{CALC}}}]", " Answer: 42"]

    def script(call: ScriptCall) -> str:
        return replies[min(call.prompt_text.count("</s>"), 1)]

    loop = ResumableAgentLoop(
        mistral, AgentLoopConfig(max_turns=4, tool_parser="auto"),
        toolset=ToolSet({"calculator": _SlowCalculator()}),
    )  # fmt: skip

    async def main() -> tuple[Sample, Sample]:
        uncut = Sample(index=0, data={"prompt": [USER]})
        await loop(uncut, ScriptedEngine(mistral, script, end_token="</s>"), NULL_TRACER)
        cut = Sample(index=0, data={"prompt": [USER]})
        task = asyncio.create_task(
            loop(cut, ScriptedEngine(mistral, script, end_token="</s>"), NULL_TRACER)
        )
        await asyncio.sleep(1.0)  # the call is running
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert cut.finish_reason is FinishReason.ABORT and cut.messages[-1]["role"] == "assistant"
        await loop(cut, ScriptedEngine(mistral, script, end_token="</s>"), NULL_TRACER)
        return uncut, cut

    uncut, resumed = run_virtual(main())
    assert resumed.finish_reason is FinishReason.STOP
    assert list(resumed.response_ids) == list(uncut.response_ids)
    assert list(resumed.loss_mask) == list(uncut.loss_mask)
    assert resumed.messages == uncut.messages  # the same call id, the same tool_call_id
