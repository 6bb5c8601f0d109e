"""verl tool-config YAML files load as they are; bad ones name the file and the field."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tailcut.tools.base import ToolSet
from tailcut.tools.code_interpreter import CodeInterpreterTool
from tailcut.tools.gsm8k import Gsm8kTool
from tailcut.tools.registry import ToolConfigError, load_tool_config

VERL_GSM8K = """
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""

VERL_SANDBOX = """
tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config:
      sandbox_fusion_url: "https://example.invalid/run_code"
      num_workers: 10
      enable_global_rate_limit: true
      rate_limit: 10
      default_timeout: 30
      default_language: "python"
      memory_limit_mb: 1024
      type: native
    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code:
              type: "string"
              description: "The code to execute."
          required: ["code"]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_verl_gsm8k_config_loads_as_is(tmp_path: Path) -> None:
    toolset = load_tool_config(write(tmp_path, VERL_GSM8K))
    tool = toolset.tools["calc_gsm8k_reward"]
    assert isinstance(tool, Gsm8kTool)
    schema = toolset.schemas()[0]
    assert schema["function"]["parameters"]["required"] == ["answer"]
    assert (
        "must be a digits"
        in schema["function"]["parameters"]["properties"]["answer"]["description"]
    )


def test_verl_sandbox_fusion_config_maps_to_the_code_interpreter(tmp_path: Path) -> None:
    toolset = load_tool_config(write(tmp_path, VERL_SANDBOX))
    tool = toolset.tools["code_interpreter"]
    assert isinstance(tool, CodeInterpreterTool)
    assert tool.config.backend == "fusion"
    assert tool.config.fusion is not None
    assert tool.config.fusion.endpoint == "https://example.invalid/run_code"
    assert tool.config.fusion.timeout_s == 30
    assert tool.config.fusion.max_concurrency == 10
    asyncio.run(toolset.aclose())


def test_tailcut_paths_timeout_and_concurrency(tmp_path: Path) -> None:
    text = """
tools:
  - class_name: tailcut.tools.gsm8k.Gsm8kTool
    config: {type: native, timeout: 3.5, max_concurrency: 2, mode: last}
  - class_name: tailcut.tools.code_interpreter.CodeInterpreterTool
    config:
      timeout: 40
      sandbox: {timeout_s: 5, memory_mb: 256}
  - class_name: tailcut.tools.calculator.CalculatorTool
"""
    toolset = load_tool_config(write(tmp_path, text))
    assert set(toolset.tools) == {"calc_gsm8k_reward", "code_interpreter", "calculator"}
    assert toolset.limits["calc_gsm8k_reward"].timeout_s == 3.5
    assert toolset.limits["calc_gsm8k_reward"].max_concurrency == 2
    assert toolset.limits["code_interpreter"].timeout_s == 40
    gsm8k = toolset.tools["calc_gsm8k_reward"]
    assert isinstance(gsm8k, Gsm8kTool) and gsm8k.config.mode == "last"
    ci = toolset.tools["code_interpreter"]
    assert isinstance(ci, CodeInterpreterTool) and ci.config.sandbox.memory_mb == 256


def test_schema_renames_our_tools(tmp_path: Path) -> None:
    text = VERL_GSM8K.replace('name: "calc_gsm8k_reward"', 'name: "check_answer"')
    toolset = load_tool_config(write(tmp_path, text))
    assert list(toolset.tools) == ["check_answer"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tools: [{}]", r"tools\.yaml: invalid tool config:\n  tools\[0\]\.class_name: Field required"),
        ("tools:\n  - class_name: verl.tools.search_tool.SearchTool\n",
         r"tools\[0\]\.class_name: verl class 'verl.tools.search_tool.SearchTool' has no tailcut counterpart"),
        ("tools:\n  - class_name: tailcut.tools.nope.Nope\n", r"tools\[0\]\.class_name: cannot import"),
        ("tools:\n  - class_name: tailcut.tools.gsm8k.Gsm8kTool\n    config: {type: mcp}\n",
         r"tools\[0\]\.config\.type: only 'native'"),
        ("tools:\n  - class_name: tailcut.tools.gsm8k.Gsm8kTool\n    config: {timeout: -1}\n",
         r"tools\[0\]\.config\.timeout: expected a number > 0, got -1"),
        ("tools:\n  - class_name: tailcut.tools.gsm8k.Gsm8kTool\n    config: {modee: best}\n",
         r"tools\[0\]\.config: modee: Extra inputs"),
        ("tools:\n  - class_name: tailcut.tools.gsm8k.Gsm8kTool\n    tool_schema: {type: function, function: {name: 'a b'}}\n",
         r"tools\[0\]\.tool_schema\.function\.name: String should match pattern"),
        ("tools:\n  - class_name: tailcut.tools.gsm8k.Gsm8kTool\n  - class_name: tailcut.tools.gsm8k.Gsm8kTool\n",
         r"tools\[1\]\.tool_schema\.function\.name: tool 'calc_gsm8k_reward' is defined twice"),
        ("tools:\n  - class_name: tailcut.tools.calculator.CalculatorTool\n    tool_schema: {function: {name: calc}}\n",
         r"tools\[0\]\.tool_schema\.function\.name: 'calc' does not match the tool's own name 'calculator'"),
        ("tools:\n  - class_name: tailcut.tools.gsm8k.Gsm8kTool\n    config: {timeout: .nan}\n",
         r"tools\[0\]\.config\.timeout: expected a number > 0, got nan"),
        ("tools:\n  - class_name: tailcut.tools.gsm8k.Gsm8kTool\n    config: {timeout: .inf}\n",
         r"tools\[0\]\.config\.timeout: expected a number > 0, got inf"),
        ("tools:\n  - class_name: tailcut.tools.gsm8k.Gsm8kTool\n    config: {max_concurrency: 0.5}\n",
         r"tools\[0\]\.config\.max_concurrency: expected a whole number, got 0\.5"),
        ("tools:\n  - class_name: tailcut.tools.gsm8k.Gsm8kTool\n    config: {max_concurrency: true}\n",
         r"tools\[0\]\.config\.max_concurrency: expected a number > 0, got True"),
        ("tools:\n  - class_name: tailcut.tools.code_interpreter.CodeInterpreterTool\n"
         "    config: {timeout: 3, default_timeout: 3}\n",
         r"tools\[0\]\.config\.timeout: 3 s is not above the longest run the tool allows itself \(30 s\)"),
        ("tools:\n  - class_name: tailcut.tools.code_interpreter.CodeInterpreterTool\n"
         "    config: {sandbox_fusion_url: 'http://127.0.0.1:1/run_code', num_workers: many}\n",
         r"tools\[0\]\.config: fusion\.max_concurrency"),
        ("tools: [\n", r"tools\.yaml:2:1: not valid YAML: while parsing a flow node"),
        ("- just a list\n", r"invalid tool config"),
    ],
)  # fmt: skip
def test_bad_configs_name_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ToolConfigError, match=message):
        load_tool_config(write(tmp_path, text))


def test_a_file_that_is_not_text_is_named(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ToolConfigError, match=r"tools\.yaml: not UTF-8 text \(byte 0\)"):
        load_tool_config(path)


def test_a_code_interpreters_time_out_lies_past_its_own_longest_run(tmp_path: Path) -> None:
    """Unset, the call's time-out lies past the longest run the sandbox allows (a program's
    own "timed out" and the output it printed reach the model); a verl Fusion config's
    time-outs also bound the local fallback."""
    text = (
        "tools:\n  - class_name: tailcut.tools.code_interpreter.CodeInterpreterTool\n"
        "    config: {sandbox_fusion_url: 'http://127.0.0.1:1/run_code', default_timeout: 45,"
        " memory_limit_mb: 512}\n"
    )
    toolset = load_tool_config(write(tmp_path, text))
    tool = toolset.tools["code_interpreter"]
    assert isinstance(tool, CodeInterpreterTool)
    assert tool.config.sandbox.timeout_s == 45 and tool.config.sandbox.memory_mb == 512
    assert tool.longest_run_s >= 45
    assert toolset.limits["code_interpreter"].timeout_s == tool.longest_run_s + 10
    # Calls beyond the server's slots wait before their time-out starts, not inside it.
    assert toolset.limits["code_interpreter"].max_concurrency == tool.parallel_runs == 10
    bare = ToolSet({"code_interpreter": CodeInterpreterTool()})  # no config: the same rules
    assert bare.limits["code_interpreter"].timeout_s == 30 + 10
    assert bare.limits["code_interpreter"].max_concurrency == 16  # the local sandbox's
    asyncio.run(toolset.aclose())
    asyncio.run(bare.aclose())


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ToolConfigError, match="does not exist"):
        load_tool_config(tmp_path / "nope.yaml")


def test_a_call_waits_for_a_sandbox_slot_before_its_time_out_starts(tmp_path: Path) -> None:
    """One sandbox slot, four programs of 1.5 s at once, 5.5 s a call: the last one ends
    over 6 s after they were sent. Waiting for the slot is not part of its time-out."""
    text = """
tools:
  - class_name: tailcut.tools.code_interpreter.CodeInterpreterTool
    config:
      timeout: 5.5
      max_timeout_s: 5
      sandbox: {timeout_s: 5, max_concurrency: 1}
"""
    toolset = load_tool_config(write(tmp_path, text))

    async def main() -> list[str]:
        async with toolset.session("s", {}) as session:
            calls = [session.call("code_interpreter", {"code": "import time; time.sleep(1.5)"})
                     for _ in range(4)]  # fmt: skip
            return [r.status for r in await asyncio.gather(*calls)]

    try:
        assert asyncio.run(main()) == ["ok"] * 4
    finally:
        asyncio.run(toolset.aclose())
