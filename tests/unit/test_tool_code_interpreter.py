"""The code_interpreter tool over both backends, and cleanup when a call is cancelled."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.fusion_server import FakeFusionServer, finished, time_limit
from fakes.procs import marked_processes
from tailcut.tools.base import ToolLimits, ToolResult, ToolSet
from tailcut.tools.code_interpreter import (
    CodeInterpreterConfig,
    CodeInterpreterTool,
    format_for_model,
    from_verl_keys,
)
from tailcut.tools.fusion import FusionConfig
from tailcut.tools.sandbox import SandboxConfig, SandboxResult

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def runs_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tailcut-ci-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def local_tool(runs_dir: Path, **sandbox: Any) -> CodeInterpreterTool:
    cfg = {
        "timeout_s": 5.0,
        "tmp_dir": str(runs_dir),
        "uid_base": 320_000,
        "uid_count": 64,
    } | sandbox
    return CodeInterpreterTool(CodeInterpreterConfig(sandbox=SandboxConfig(**cfg)))


def result(status: Any, stdout: str = "", stderr: str = "", **kw: Any) -> SandboxResult:
    return SandboxResult(status=status, stdout=stdout, stderr=stderr, exit_code=kw.pop("exit_code", 0),
                         duration_s=0.1, **kw)  # fmt: skip


def test_model_reads_stdout_then_stderr_then_how_the_run_ended() -> None:
    assert format_for_model(result("ok", "4\n"), 100) == "4"
    assert format_for_model(result("ok"), 100) == "(no output)"
    text = format_for_model(result("error", "a\n", "Traceback\nValueError: x\n", exit_code=1), 100)
    assert text == "a\nTraceback\nValueError: x\n[Exit code 1]"
    text = format_for_model(result("timeout", "partial", detail="wall-clock limit 2 s"), 100)
    assert text == "partial\n[Timed out: wall-clock limit 2 s]"
    text = format_for_model(result("ok", "x" * 50), 10)
    assert text.startswith("x" * 10 + "\n[... output cut at 10 characters]")


def test_local_backend_runs_code_in_a_session(runs_dir: Path) -> None:
    async def main() -> list[ToolResult]:
        tool = local_tool(runs_dir)
        toolset = ToolSet({tool.name: tool})
        async with toolset.session("t1") as s:
            out = [
                await s.call("code_interpreter", {"code": "print(sum(range(10)))"}),
                await s.call("code_interpreter", {"code": "1/0"}),
                await s.call("code_interpreter", {"code": ""}),
                await s.call(
                    "code_interpreter", {"code": "import time; time.sleep(10)", "timeout": 0.5}
                ),
            ]
        assert tool.open_instances == 0
        return out

    ok, err, empty, slow = asyncio.run(main())
    assert (ok.status, ok.text) == ("ok", "45")
    assert err.status == "code_error" and "ZeroDivisionError" in err.text
    assert empty.status == "bad_arguments"
    assert slow.status == "code_timeout" and "Timed out" in slow.text
    assert list(runs_dir.iterdir()) == []


def test_fusion_backend_with_verl_config_keys() -> None:
    async def main() -> None:
        replies = iter([finished(stdout="45\n"), time_limit()])
        async with FakeFusionServer(lambda req: next(replies)) as server:
            verl_config = {"sandbox_fusion_url": server.url + "/run_code", "default_timeout": 7,
                           "memory_limit_mb": 256, "num_workers": 4}  # fmt: skip
            tool = CodeInterpreterTool.from_config(verl_config, None)
            toolset = ToolSet({tool.name: tool})
            async with toolset.session("t2") as s:
                ok = await s.call("code_interpreter", {"code": "print(45)"})
                slow = await s.call("code_interpreter", {"code": "while True: pass"})
            await toolset.aclose()
        assert (ok.status, ok.text) == ("ok", "45")
        assert slow.status == "code_timeout"
        assert server.requests[0]["run_timeout"] == 7
        assert server.requests[0]["memory_limit_MB"] == 256

    asyncio.run(main())


def test_fusion_server_error_becomes_an_error_message_not_a_crash() -> None:
    async def main() -> ToolResult:
        async with FakeFusionServer() as server:
            server.faults.append(500)
            cfg = CodeInterpreterConfig(backend="fusion", fusion=FusionConfig(url=server.url))
            tool = CodeInterpreterTool(cfg)
            async with ToolSet({tool.name: tool}).session("t3") as s:
                out = await s.call("code_interpreter", {"code": "print(1)"})
            await tool.aclose()
            return out

    out = asyncio.run(main())
    assert out.status == "error"
    assert "HTTP 500" in out.text and "injected failure" in out.text


def test_verl_keys_translate_to_our_config() -> None:
    cfg = CodeInterpreterConfig.model_validate(
        from_verl_keys(
            {"sandbox_fusion_url": "http://h:8080/run_code", "default_timeout": 9, "rate_limit": 3}
        )
    )
    assert cfg.backend == "fusion" and cfg.fusion is not None
    assert (cfg.fusion.url, cfg.fusion.timeout_s, cfg.fusion.max_concurrency) == (
        "http://h:8080/run_code",
        9,
        3,
    )
    local = CodeInterpreterConfig.model_validate(
        from_verl_keys({"default_timeout": 4, "memory_limit_mb": 300})
    )
    assert (local.backend, local.sandbox.timeout_s, local.sandbox.memory_mb) == ("local", 4, 300)


class RecordingTool(CodeInterpreterTool):
    """The real tool, recording when ``release`` ran."""

    released_at: float | None = None

    async def release(self, instance_id: str) -> None:
        self.released_at = time.monotonic()
        await super().release(instance_id)


def test_cancelled_call_releases_the_tool_and_kills_the_program_within_100ms(
    runs_dir: Path,
) -> None:
    mark = os.urandom(6).hex()
    code = "import os, time\nprint('ready', flush=True)\ntime.sleep(60)\n"

    async def main() -> tuple[RecordingTool, float, float]:
        started = asyncio.Event()
        cfg = CodeInterpreterConfig(sandbox=SandboxConfig(
            timeout_s=30, tmp_dir=str(runs_dir), env={"SANDBOX_TEST_MARK": mark},
            uid_base=320_000, uid_count=64))  # fmt: skip
        tool = RecordingTool(cfg)
        tool.backend.sandbox.run = _notify_on_ready(tool.backend.sandbox.run, started)  # type: ignore[attr-defined]
        toolset = ToolSet({tool.name: tool}, {tool.name: ToolLimits(timeout_s=60)})

        async def trajectory() -> None:
            async with toolset.session("t4") as s:
                await s.call("code_interpreter", {"code": code})

        task = asyncio.create_task(trajectory())
        await asyncio.wait_for(started.wait(), 20)
        cancelled_at = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return tool, cancelled_at, time.monotonic()

    tool, cancelled_at, done_at = asyncio.run(main())
    assert tool.open_instances == 0
    assert tool.released_at is not None
    assert marked_processes(mark) == []
    assert list(runs_dir.iterdir()) == []
    elapsed = done_at - cancelled_at
    print(
        f"cancel to released: {(tool.released_at - cancelled_at) * 1000:.1f} ms, to clean: {elapsed * 1000:.1f} ms"
    )
    assert elapsed < 5.0, f"cleanup took {elapsed:.3f} s"  # not the sleeper's end


def _notify_on_ready(run: Any, event: asyncio.Event) -> Any:
    async def wrapped(code: str, **kw: Any) -> SandboxResult:
        def on_output(stream: str, chunk: bytes) -> None:
            if b"ready" in chunk:
                event.set()

        return await run(code, on_output=on_output, **kw)

    return wrapped
