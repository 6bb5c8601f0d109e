"""``code_interpreter`` on a Sandbox Fusion server, with the local sandbox as the fallback.

:class:`FallbackBackend` sends each program to the server; when the server cannot run it
(:class:`~tailcut.tools.fusion.FusionError`: unreachable after the client's retries, an
HTTP error, a ``SandboxError`` reply) the local sandbox runs it instead and the server is
left alone for ``retry_after_s`` (calls in that window go straight to the local sandbox),
then tried again. Errors of the program itself are results, not failures: they never fall
back. Cancelling a call cancels whichever sandbox is running it.

:class:`FallbackCodeInterpreterTool` is the tool (a verl tool-config ``class_name``): the
keys of :class:`~tailcut.tools.code_interpreter.CodeInterpreterConfig` or verl's
``SandboxFusionTool`` keys (``sandbox_fusion_url``, ``default_timeout``, ...), plus
``fallback`` (``local``, the default, or ``none``) and ``fallback_retry_s``. Without a
server URL it is the local sandbox alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from tailcut.tools.code_interpreter import (
    CodeBackend,
    CodeInterpreterConfig,
    CodeInterpreterTool,
    from_verl_keys,
    make_backend,
)
from tailcut.tools.fusion import FusionError
from tailcut.tools.sandbox import SandboxResult

log = logging.getLogger(__name__)


class FallbackBackend:
    """``primary`` (a Sandbox Fusion client) unless it fails; then ``fallback``."""

    def __init__(
        self,
        primary: CodeBackend,
        fallback: CodeBackend,
        *,
        retry_after_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self.retry_after_s = retry_after_s
        self.clock = clock
        self._down_until: float | None = None
        self.fallback_runs = 0
        """Programs the fallback ran (for metrics and tests)."""

    async def run(
        self, code: str, *, timeout_s: float | None = None, stdin: str | None = None
    ) -> SandboxResult:
        if self._down_until is None or self.clock() >= self._down_until:
            try:
                result = await self.primary.run(code, timeout_s=timeout_s, stdin=stdin)
            except FusionError as exc:
                if self._down_until is None:
                    log.warning(
                        "Sandbox Fusion failed (%s); running code in the local sandbox, "
                        "retrying the server in %.0f s",
                        exc,
                        self.retry_after_s,
                    )
                self._down_until = self.clock() + self.retry_after_s
            else:
                if self._down_until is not None:
                    log.warning("Sandbox Fusion answers again; code runs there")
                self._down_until = None
                return result
        self.fallback_runs += 1
        return await self.fallback.run(code, timeout_s=timeout_s, stdin=stdin)

    async def aclose(self) -> None:
        try:
            await self.primary.aclose()
        finally:
            await self.fallback.aclose()


class FallbackCodeInterpreterTool(CodeInterpreterTool):
    """``code_interpreter`` on Sandbox Fusion, falling back to the local sandbox."""

    def __init__(
        self,
        config: CodeInterpreterConfig | None = None,
        schema: dict[str, Any] | None = None,
        *,
        fallback: Literal["local", "none"] = "local",
        retry_after_s: float = 60.0,
    ) -> None:
        config = config or CodeInterpreterConfig()
        backend = make_backend(config)
        if config.backend == "fusion" and fallback == "local":
            local = make_backend(config.model_copy(update={"backend": "local"}))
            backend = FallbackBackend(backend, local, retry_after_s=retry_after_s)
        super().__init__(config, schema, backend)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], tool_schema: dict[str, Any] | None
    ) -> FallbackCodeInterpreterTool:
        options = dict(config)
        fallback = options.pop("fallback", "local")
        if fallback not in ("local", "none"):
            raise ValueError(f"fallback must be 'local' or 'none', got {fallback!r}")
        retry = options.pop("fallback_retry_s", 60.0)
        if isinstance(retry, bool) or not isinstance(retry, int | float) or retry < 0:
            raise ValueError(f"fallback_retry_s must be a number of seconds >= 0, got {retry!r}")
        parsed = CodeInterpreterConfig.model_validate(from_verl_keys(options))
        return cls(parsed, tool_schema, fallback=fallback, retry_after_s=float(retry))
