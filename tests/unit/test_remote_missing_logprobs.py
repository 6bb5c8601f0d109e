"""A server answer without a log-prob for a token (``null``, or the entry missing) is NaN in
the client's result, never 0.0 (issue 13: a 0.0 makes the importance ratio π itself) —
the vLLM and SGLang clients against their fake servers."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
import test_vllm_engine_fake as vllm_fake  # tests/unit is on sys.path (rootdir imports)

from fakes.sglang_server import FakeSGLangServer, fake_logprob, fake_servers
from tailcut.chat.tokenize import append_sampled
from tailcut.config import RemoteEngineConfig
from tailcut.engine.sglang import SGLangEngine
from tailcut.types import FinishReason, GenerateRequest, Sample, SamplingParams, new_request_id

pytestmark = pytest.mark.timeout(60)

HOLES = (1, 3)
"""The output positions whose log-prob the server leaves out."""


def _req(n: int) -> GenerateRequest:
    return GenerateRequest(new_request_id(), [1, 2, 3], SamplingParams(max_new_tokens=n))


def _nan_at(values: list[float] | None) -> list[int]:
    assert values is not None
    return [i for i, v in enumerate(values) if math.isnan(v)]


# -- vLLM ----------------------------------------------------------------------------------


def _vllm_event(holes: tuple[int, ...], drop_key: bool) -> Any:
    """``_event`` of the vLLM fake, with ``null`` for the tokens at ``holes`` (counted per
    request from the token ids themselves: the fake's ids are 10 + position), or with no
    ``logprobs`` key at all when ``drop_key``."""

    def event(rid: str, ids: list[int], finish: str | None) -> bytes:
        choice: dict[str, Any] = {
            "index": 0,
            "text": "",
            "finish_reason": finish,
            "token_ids": ids,
        }
        if not drop_key:
            lps = [None if t - 10 in holes else -0.5 for t in ids]
            choice["logprobs"] = {"token_logprobs": lps, "tokens": [""] * len(ids)}
        return b"data: " + json.dumps({"id": rid[:-2], "choices": [choice]}).encode() + b"\n\n"

    return event


def test_vllm_null_token_logprob_is_nan_not_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_fake, "_event", _vllm_event(HOLES, drop_key=False))

    async def main() -> None:
        async with vllm_fake.fake_vllm() as (_server, engine):
            result = await engine.generate(_req(5))
        assert result.output_ids == [10, 11, 12, 13, 14]
        assert result.finish_reason is FinishReason.LENGTH
        assert result.logprobs is not None and len(result.logprobs) == 5
        assert _nan_at(result.logprobs) == list(HOLES)
        assert 0.0 not in result.logprobs
        assert [result.logprobs[i] for i in (0, 2, 4)] == [-0.5, -0.5, -0.5]

    asyncio.run(main())


def test_vllm_answer_without_logprobs_is_recorded_as_nan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No ``logprobs`` at all: the result holds none (not a list of zeros), and the sample
    records NaN for every sampled token."""
    monkeypatch.setattr(vllm_fake, "_event", _vllm_event((), drop_key=True))

    async def main() -> Any:
        async with vllm_fake.fake_vllm() as (_server, engine):
            return await engine.generate(_req(4))

    result = asyncio.run(main())
    assert result.output_ids == [10, 11, 12, 13] and result.logprobs is None
    sample = Sample(index=0, data={})
    append_sampled(sample, result.output_ids, result.logprobs, version=0)
    assert len(sample.logprobs) == 4 and all(math.isnan(x) for x in sample.logprobs)


# -- SGLang --------------------------------------------------------------------------------


def _holey_out(holes: tuple[int, ...], kind: str) -> Any:
    """``FakeSGLangServer._out`` whose ``output_token_logprobs`` entry at each absolute
    position in ``holes`` is ``[null, token, null]`` (kind ``null``) or ``null`` (``missing``)."""
    original = FakeSGLangServer._out

    def out(self: FakeSGLangServer, req: Any, start: int) -> dict[str, Any]:
        answer = original(self, req, start)
        entries = answer["meta_info"]["output_token_logprobs"]
        for i, entry in enumerate(entries):
            if start + i in holes:
                entries[i] = [None, entry[1], None] if kind == "null" else None
        return answer

    return out


@pytest.mark.parametrize("kind", ["null", "missing"])
@pytest.mark.parametrize(
    ("stream", "incremental"),
    [(False, False), (True, False), (True, True)],
    ids=["whole", "stream-cumulative", "stream-incremental"],
)
def test_sglang_token_without_logprob_is_nan_not_zero(
    monkeypatch: pytest.MonkeyPatch, kind: str, stream: bool, incremental: bool
) -> None:
    monkeypatch.setattr(FakeSGLangServer, "_out", _holey_out(HOLES, kind))

    async def main() -> Any:
        async with fake_servers(1, incremental=incremental) as (server,):
            cfg = RemoteEngineConfig(ready_timeout_s=5.0, reabort_interval_s=0.05, stream=stream)
            async with SGLangEngine([server.url], cfg, abort_deadline_s=2.0) as engine:
                return await engine.generate(_req(6))

    result = asyncio.run(main())
    assert result.finish_reason is FinishReason.LENGTH and len(result.output_ids) == 6
    assert result.logprobs is not None and len(result.logprobs) == 6  # aligned, not dropped
    assert _nan_at(result.logprobs) == list(HOLES)
    assert 0.0 not in result.logprobs
    rid = result.request_id
    for i in (0, 2, 4, 5):
        assert result.logprobs[i] == pytest.approx(fake_logprob(rid, i))
