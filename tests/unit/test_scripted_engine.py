"""The scripted test engine keeps the Engine contract: stop, length, abort, cancel ⇒ abort."""

from __future__ import annotations

import asyncio

import pytest

from fakes.scripted_engine import ScriptCall, ScriptedEngine, count_turns, ramble
from tailcut.chat.template import decode, encode, render_ids
from tailcut.engine.base import Engine
from tailcut.types import FinishReason, GenerateRequest, SamplingParams, new_request_id
from tailcut.vtime import run_virtual


def _request(tok, max_new_tokens: int = 100, **kw) -> GenerateRequest:
    prompt = render_ids(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    sampling = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(im_end,), **kw)
    return GenerateRequest(new_request_id(), prompt, sampling)


def test_reply_ends_with_the_end_of_turn_token_and_the_script_sees_the_prompt(chat_tokenizer):
    seen: list[ScriptCall] = []

    def script(call: ScriptCall) -> str:
        seen.append(call)
        return "#### 4"

    engine = ScriptedEngine(chat_tokenizer, script)
    assert isinstance(engine, Engine)
    req = _request(chat_tokenizer)
    result = run_virtual(engine.generate(req))
    assert result.finish_reason is FinishReason.STOP
    assert decode(chat_tokenizer, result.output_ids) == "#### 4<|im_end|>"
    assert result.logprobs is not None and len(result.logprobs) == len(result.output_ids)
    assert seen[0].turn == 0 and seen[0].prompt_text.endswith("<|im_start|>assistant\n")


def test_max_new_tokens_cuts_with_length_and_ignore_eos_runs_on(chat_tokenizer):
    tok = chat_tokenizer
    engine = ScriptedEngine(tok, lambda c: ramble(100))
    result = run_virtual(engine.generate(_request(tok, max_new_tokens=7)))
    assert result.finish_reason is FinishReason.LENGTH and len(result.output_ids) == 7
    engine = ScriptedEngine(tok, lambda c: "a<|im_end|>b c d")
    stopped = run_virtual(engine.generate(_request(tok)))
    assert decode(tok, stopped.output_ids) == "a<|im_end|>"
    ignoring = run_virtual(engine.generate(_request(tok, ignore_eos=True)))
    assert decode(tok, ignoring.output_ids) == "a<|im_end|>b c d<|im_end|>"


def test_abort_returns_partial_tokens_and_is_idempotent(chat_tokenizer):
    tok = chat_tokenizer
    engine = ScriptedEngine(tok, lambda c: ramble(300), token_delay_s=0.01)
    req = _request(tok, max_new_tokens=1000)

    async def main():
        task = asyncio.create_task(engine.generate(req))
        await asyncio.sleep(0.055)
        assert await engine.in_flight() == [req.request_id]
        await engine.abort([req.request_id, "tc-unknown-id-000000000"])
        await engine.abort([req.request_id])
        return await task

    result = run_virtual(main())
    assert result.finish_reason is FinishReason.ABORT
    assert result.output_ids == encode(tok, ramble(300))[:5]
    assert engine.aborted == [req.request_id]
    stats = run_virtual(engine.stats())
    assert (stats.aborted, stats.wasted_tokens, stats.running) == (1, 5, 0)


def test_cancelling_the_caller_aborts_the_request(chat_tokenizer):
    tok = chat_tokenizer
    engine = ScriptedEngine(tok, lambda c: ramble(300), token_delay_s=0.01)
    req = _request(tok, max_new_tokens=1000)

    async def main():
        task = asyncio.create_task(engine.generate(req))
        await asyncio.sleep(0.035)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_virtual(main())
    assert engine.abort_requests == [req.request_id]
    assert engine.aborted == [req.request_id]
    assert run_virtual(engine.in_flight()) == []


def test_turns_are_counted_from_the_chatml_prompt():
    text = (
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n<|im_start|>assistant\n"
    )
    assert count_turns(text) == 1
    assert count_turns("<|im_start|>assistant\n") == 0
