"""The schedule's priority reaches the request bodies of the remote engines that have one."""

from tailcut.config import RemoteEngineConfig
from tailcut.engine.vllm import VLLMEngine
from tailcut.types import GenerateRequest, SamplingParams, new_request_id


def _req(priority: int | None) -> GenerateRequest:
    return GenerateRequest(new_request_id(), [1, 2], SamplingParams(priority=priority))


def test_vllm_body_carries_the_priority_only_when_set():
    engine = VLLMEngine(["http://127.0.0.1:9"], RemoteEngineConfig(model_name="m"))
    assert engine.body(_req(7))["priority"] == 7
    assert "priority" not in engine.body(_req(None))
