"""The ``code_interpreter`` tool: runs the model's code in the local sandbox or on a
Sandbox Fusion server, and answers with what the program printed.

The model reads stdout then stderr (what verl's sandbox tool shows), followed by a
bracketed note when the run did not end normally (timeout, memory, killed, exit code).
Programs that fail are answered, not raised: the trajectory goes on. A failure of the
sandbox itself (:class:`~tailcut.tools.sandbox.SandboxError`,
:class:`~tailcut.tools.fusion.FusionError`) raises, and the tool session turns it into
an error message. Cancelling a call kills the program and everything it started.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from tailcut.tools.base import ToolResult
from tailcut.tools.fusion import FusionConfig, SandboxFusionClient
from tailcut.tools.sandbox import LocalSandbox, SandboxConfig, SandboxResult

TOOL_NAME = "code_interpreter"

SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run Python code and see what it prints (stdout and stderr).",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The Python program to run; print the results you need."},
            },
            "required": ["code"],
        },
    },
}  # fmt: skip


class CodeBackend(Protocol):
    async def run(
        self, code: str, *, timeout_s: float | None = None, stdin: str | None = None
    ) -> SandboxResult: ...

    async def aclose(self) -> None: ...


class CodeInterpreterConfig(BaseModel):
    """The ``code_interpreter`` tool: which backend, and how much output the model reads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["local", "fusion"] = "local"
    """``local``: the sandbox on this machine; ``fusion``: a Sandbox Fusion server."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Local sandbox limits (backend ``local``)."""
    fusion: FusionConfig | None = None
    """Server and client settings (backend ``fusion``)."""
    max_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Largest ``timeout`` a call may ask for."""
    max_output_chars: int = Field(8192, ge=64, le=10_000_000)
    """The reply to the model keeps this many characters of the output."""


class _LocalBackend:
    def __init__(self, config: SandboxConfig):
        self.sandbox = LocalSandbox(config)

    async def run(
        self, code: str, *, timeout_s: float | None = None, stdin: str | None = None
    ) -> SandboxResult:
        return await self.sandbox.run(code, timeout_s=timeout_s, stdin=stdin)

    async def aclose(self) -> None:
        return None


def make_backend(config: CodeInterpreterConfig) -> CodeBackend:
    if config.backend == "fusion":
        if config.fusion is None:
            raise ValueError(
                "code_interpreter backend 'fusion' needs a 'fusion' section with its url"
            )
        return SandboxFusionClient(config.fusion)
    return _LocalBackend(config.sandbox)


def _note(result: SandboxResult) -> str:
    if result.status == "ok":
        return ""
    if result.status == "error":
        return f"[Exit code {result.exit_code}]"
    label = {"timeout": "Timed out", "memory": "Memory limit exceeded", "killed": "Killed"}
    return (
        f"[{label[result.status]}: {result.detail}]"
        if result.detail
        else f"[{label[result.status]}]"
    )


def format_for_model(result: SandboxResult, max_chars: int) -> str:
    """stdout, stderr and a note on how the run ended, cut to ``max_chars``."""
    parts = [p for p in (result.stdout, result.stderr) if p]
    text = "".join(p if p.endswith("\n") else p + "\n" for p in parts)
    if len(text) > max_chars:
        text = text[:max_chars] + f"\n[... output cut at {max_chars} characters]\n"
    note = _note(result)
    if note:
        text += note
    return text.rstrip("\n") or "(no output)"


class CodeInterpreterTool:
    """Runs code for the model; gives no reward of its own."""

    def __init__(
        self,
        config: CodeInterpreterConfig | None = None,
        schema: dict[str, Any] | None = None,
        backend: CodeBackend | None = None,
    ):
        self.config = config or CodeInterpreterConfig()
        self.backend = backend or make_backend(self.config)
        self._schema = copy.deepcopy(schema or SCHEMA)
        self.name: str = self._schema["function"]["name"]
        self._instances: dict[str, int] = {}

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], tool_schema: dict[str, Any] | None
    ) -> CodeInterpreterTool:
        """Our own config keys, or verl's SandboxFusionTool keys (``sandbox_fusion_url``,
        ``default_timeout``, ``memory_limit_mb``, ``num_workers``/``rate_limit``)."""
        return cls(CodeInterpreterConfig.model_validate(from_verl_keys(config)), tool_schema)

    def schema(self) -> dict[str, Any]:
        return self._schema

    @property
    def longest_run_s(self) -> float:
        """The longest a program runs by this tool's limits (what a call asks, at most
        ``max_timeout_s``; the backend's default otherwise, Fusion's with its fallback's)."""
        c = self.config
        bounds = [c.max_timeout_s, c.sandbox.timeout_s]
        if c.fusion is not None:
            bounds.append(c.fusion.timeout_s + c.fusion.compile_timeout_s)
        return max(bounds)

    @property
    def parallel_runs(self) -> int:
        """Programs its backend runs at once (the rest wait for a slot)."""
        c = self.config
        return c.fusion.max_concurrency if c.fusion is not None else c.sandbox.max_concurrency

    @property
    def open_instances(self) -> int:
        return len(self._instances)

    async def create(self, instance_id: str, **_: Any) -> None:
        self._instances[instance_id] = 0

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ValueError("'code' must be a non-empty string of Python code")
        timeout = arguments.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise ValueError(f"'timeout' must be a positive number of seconds, got {timeout!r}")
        limit = min(float(timeout), self.config.max_timeout_s) if timeout else None
        self._instances[instance_id] = self._instances.get(instance_id, 0) + 1
        result = await self.backend.run(code, timeout_s=limit)
        status = "ok" if result.status == "ok" else f"code_{result.status}"
        metrics = {"sandbox_run_s": float(result.run_s or result.duration_s)}
        return ToolResult(
            format_for_model(result, self.config.max_output_chars), status, 0.0, metrics
        )

    async def calc_reward(self, instance_id: str) -> float:
        return 0.0

    async def release(self, instance_id: str) -> None:
        self._instances.pop(instance_id, None)

    async def aclose(self) -> None:
        await self.backend.aclose()


def from_verl_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """Translate verl's SandboxFusionTool ``config`` into :class:`CodeInterpreterConfig`."""
    out = {k: v for k, v in config.items() if k not in _VERL_KEYS}
    sandbox = dict(out.get("sandbox") or {})  # also the local fallback of a Fusion server
    if "default_timeout" in config:
        sandbox.setdefault("timeout_s", config["default_timeout"])
    if "memory_limit_mb" in config:
        sandbox.setdefault("memory_mb", config["memory_limit_mb"])
    if sandbox:
        out["sandbox"] = sandbox
    url = config.get("sandbox_fusion_url")
    if url:
        fusion = dict(out.get("fusion") or {})
        fusion.setdefault("url", url)
        for verl_key, ours in (("default_timeout", "timeout_s"), ("memory_limit_mb", "memory_limit_mb"),
                               ("default_language", "language")):  # fmt: skip
            if verl_key in config:
                fusion.setdefault(ours, config[verl_key])
        workers = config.get("rate_limit") or config.get("num_workers")
        if workers:
            fusion.setdefault("max_concurrency", workers)  # validated there, named
        out["fusion"] = fusion
        out.setdefault("backend", "fusion")
    return out


_VERL_KEYS = frozenset({
    "sandbox_fusion_url", "default_timeout", "default_language", "memory_limit_mb",
    "num_workers", "rate_limit", "enable_global_rate_limit",
})  # fmt: skip
