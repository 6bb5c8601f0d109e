"""Loss masks and incremental tokenization, by property.

For random conversations (assistant text with and without tool calls, several tool
results a turn, unicode, blank lines):

* ``response_ids`` / ``loss_mask`` / ``logprobs`` / ``versions`` stay aligned;
* decoding the masked-in tokens gives exactly the assistant text the engine sampled;
* the incremental ids equal a full re-render of the same conversation.

The re-render equivalence needs the sampled tokens to be the canonical tokenization of the
assistant text, and that text not to start with whitespace (a byte-level BPE can merge it
with the ``\\n`` of the role header in a one-piece render; the loop keeps the sampled split,
which is what the policy saw).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes.scripted_engine import ScriptedEngine
from tailcut.chat.parser import format_tool_call
from tailcut.chat.template import decode, encode, render_ids
from tailcut.chat.tokenize import IncrementalChat
from tailcut.config import AgentLoopConfig
from tailcut.rollout.agent_loop import AgentLoop
from tailcut.tools.base import ToolResult, ToolSet
from tailcut.trace.events import NULL_TRACER
from tailcut.types import FinishReason, Sample
from tailcut.vtime import run_virtual

ALPHABET = st.sampled_from([*"abcxyz 0123456789.,;:!?'\"()[]{}#*+-=/\n\t", "é", "ß", "中", "🍎"])
text = st.text(ALPHABET, max_size=40)
lead = st.text(ALPHABET, min_size=1, max_size=40).filter(lambda s: not s[0].isspace())
args = st.dictionaries(
    st.sampled_from(["text", "answer", "n"]), st.one_of(text, st.integers()), max_size=2
)


@st.composite
def assistant_text(draw: Any, calls: bool) -> str:
    head = draw(lead)
    if not calls:
        return head
    blocks = [format_tool_call("echo", draw(args)) for _ in range(draw(st.integers(1, 3)))]
    return head + draw(st.sampled_from(["\n", " ", ""])) + "".join(blocks)


@st.composite
def conversations(draw: Any) -> tuple[list[dict[str, str]], list[str], list[list[str]]]:
    """(prompt messages, assistant texts, tool results after each tool-calling turn)."""
    prompt = [{"role": "user", "content": draw(lead)}]
    if draw(st.booleans()):
        prompt.insert(0, {"role": "system", "content": draw(lead)})
    n_tool_turns = draw(st.integers(0, 3))
    replies = [draw(assistant_text(calls=True)) for _ in range(n_tool_turns)]
    replies.append(draw(assistant_text(calls=False)))
    results = [[draw(text) for _ in range(reply.count("<tool_call>"))] for reply in replies[:-1]]
    return prompt, replies, results


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations())
def test_incremental_tokens_equal_a_full_rerender(chat_tokenizer, conv):
    tok = chat_tokenizer
    prompt, replies, results = conv
    tools = ToolSet({"echo": _ScriptedTool([])}).schemas()
    chat = IncrementalChat(tok, prompt, tools)
    ids = list(chat.prompt_ids)
    for k, reply in enumerate(replies):
        sampled = encode(tok, reply) + encode(tok, "<|im_end|>")
        assert chat.add_assistant(sampled) == reply
        ids += sampled
        if k < len(results):
            ids += chat.add_messages([{"role": "tool", "content": r} for r in results[k]])
    assert ids + encode(tok, chat.pending_text) == render_ids(tok, chat.messages, tools)


class _ScriptedTool:
    """Answers the i-th call with ``results[i]`` (the texts drawn for the conversation)."""

    name = "echo"

    def __init__(self, results: list[str]) -> None:
        self.results = iter(results)

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        return None

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(next(self.results, json.dumps(arguments)))

    async def calc_reward(self, instance_id: str) -> float:
        return 0.0

    async def release(self, instance_id: str) -> None:
        return None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), st.integers(8, 400))
def test_agent_loop_masks_select_exactly_the_sampled_text(chat_tokenizer, conv, budget):
    tok = chat_tokenizer
    prompt, replies, results = conv
    flat = [r for turn in results for r in turn]
    engine = ScriptedEngine(tok, lambda call: replies[min(call.turn, len(replies) - 1)])
    cfg = AgentLoopConfig(max_response_tokens=budget, max_tool_response_chars=10_000)
    loop = AgentLoop(tok, cfg, toolset=ToolSet({"echo": _ScriptedTool(flat)}))
    sample = Sample(index=0, data={"prompt": prompt})
    run_virtual(loop(sample, engine, NULL_TRACER))

    n = len(sample.response_ids)
    assert len(sample.loss_mask) == len(sample.logprobs) == len(sample.versions) == n <= budget
    sampled = [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if m]
    expected = [r.output_ids for r in engine.results]
    assert sampled == [t for out in expected for t in out]  # exactly as generated, in order
    assert decode(tok, sampled) == "".join(decode(tok, out) for out in expected)
    assert sample.generated_tokens == len(sampled)
    assert all(v == -1 for v, m in zip(sample.versions, sample.loss_mask, strict=True) if not m)
    if sample.finish_reason is FinishReason.STOP:
        assert decode(tok, sampled) == "".join(r + "<|im_end|>" for r in replies)
        full = render_ids(tok, sample.messages, loop.schemas)
        assert [*sample.prompt_ids, *sample.response_ids, *encode(tok, "\n")] == full
    else:
        assert sample.finish_reason is FinishReason.LENGTH
    if n:
        assert sample.loss_mask[-1] == 1  # a trajectory never ends on tool output
