"""Client of a Sandbox Fusion server (``POST {url}/run_code``).

Request: ``code``, ``language``, ``run_timeout``, ``compile_timeout``,
``memory_limit_MB``, ``stdin``, ``files``. Reply: ``status`` (``Success`` / ``Failed`` /
``SandboxError``), ``message``, ``compile_result`` and ``run_result`` (``status``:
``Finished`` / ``TimeLimitExceeded`` / ``Error``; ``stdout``, ``stderr``, ``return_code``,
``execution_time``). Replies become the same :class:`SandboxResult` the local sandbox
gives. Connection errors and 429/502/503/504 are retried with exponential back-off; other
HTTP errors and ``SandboxError`` replies raise :class:`FusionError` with the server's
message. At most ``max_concurrency`` requests are in flight.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import random
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tailcut.errors import TailcutError
from tailcut.tools.sandbox import SandboxResult, SandboxStatus, looks_like_memory_error

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 502, 503, 504})


class FusionError(TailcutError, RuntimeError):
    """The Sandbox Fusion server could not run the code (not an error of the code)."""


class FusionConfig(BaseModel):
    """Where the Sandbox Fusion server is and how to talk to it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(min_length=1)
    """Server base URL, or the full ``.../run_code`` endpoint (verl's ``sandbox_fusion_url``)."""
    language: str = "python"
    """Language of the code unless a call names another."""
    timeout_s: float = Field(30.0, gt=0, le=3600)
    """``run_timeout`` unless a call asks for less."""
    compile_timeout_s: float = Field(10.0, gt=0, le=3600)
    """``compile_timeout`` (compiled languages)."""
    memory_limit_mb: int = Field(1024, ge=-1)
    """``memory_limit_MB`` (-1: the server's default)."""
    max_concurrency: int = Field(10, ge=1, le=4096)
    """Requests in flight at once from this client."""
    retries: int = Field(3, ge=0, le=100)
    """Extra attempts after a connection error or a 429/502/503/504."""
    backoff_s: float = Field(0.5, ge=0, le=60)
    """First back-off; doubles on each retry (with jitter)."""
    backoff_max_s: float = Field(8.0, ge=0, le=600)
    """Longest back-off."""
    http_margin_s: float = Field(10.0, ge=0, le=600)
    """HTTP timeout = compile + run timeout + this margin."""

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{url!r} is not an http(s)://HOST[:PORT] URL")
        return url

    @property
    def endpoint(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/run_code") else f"{url}/run_code"


class _Retryable(Exception):
    pass


def _server_message(body: str) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:500] or "(empty body)"
    if isinstance(data, dict):
        for key in ("message", "detail", "error"):
            if data.get(key):
                return str(data[key])[:500]
    return body.strip()[:500]


class SandboxFusionClient:
    """Runs code on a Sandbox Fusion server. Close with :meth:`aclose` (or ``async with``)."""

    def __init__(self, config: FusionConfig, session: aiohttp.ClientSession | None = None):
        self.config = config
        self._session = session
        self._own_session = session is None
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self.attempts = 0
        """HTTP attempts made (retries included), for metrics and tests."""

    async def __aenter__(self) -> SandboxFusionClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None and self._own_session:
            await self._session.close()
        self._session = None

    async def run(
        self,
        code: str,
        *,
        language: str | None = None,
        timeout_s: float | None = None,
        stdin: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> SandboxResult:
        cfg = self.config
        run_timeout = min(timeout_s or cfg.timeout_s, cfg.timeout_s)
        payload = {
            "code": code,
            "language": language or cfg.language,
            "run_timeout": run_timeout,
            "compile_timeout": cfg.compile_timeout_s,
            "memory_limit_MB": cfg.memory_limit_mb,
            "stdin": stdin or "",
            "files": {k: base64.b64encode(v).decode() for k, v in (files or {}).items()},
            "fetch_files": [],
        }
        started = time.monotonic()
        async with self._slots:
            reply = await self._post_with_retries(payload, run_timeout)
        return to_result(reply, time.monotonic() - started, run_timeout, self.config.endpoint)

    async def _post_with_retries(
        self, payload: dict[str, Any], run_timeout: float
    ) -> dict[str, Any]:
        cfg = self.config
        last = ""
        for attempt in range(cfg.retries + 1):
            if attempt:
                delay = min(cfg.backoff_max_s, cfg.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))  # back-off, not a poll
            try:
                return await self._post(payload, run_timeout)
            except _Retryable as exc:
                last = str(exc)
                log.warning("sandbox fusion attempt %d/%d: %s", attempt + 1, cfg.retries + 1, last)
        raise FusionError(
            f"Sandbox Fusion at {cfg.endpoint} failed after {cfg.retries + 1} attempts: {last}"
        )

    async def _post(self, payload: dict[str, Any], run_timeout: float) -> dict[str, Any]:
        cfg = self.config
        if self._session is None:
            self._session = aiohttp.ClientSession()
        self.attempts += 1
        http_timeout = aiohttp.ClientTimeout(
            total=run_timeout + cfg.compile_timeout_s + cfg.http_margin_s
        )
        try:
            async with self._session.post(cfg.endpoint, json=payload, timeout=http_timeout) as resp:
                body = await resp.text()
                status = resp.status
        except aiohttp.ClientConnectionError as exc:
            raise _Retryable(f"connection error: {type(exc).__name__}: {exc}") from exc
        except TimeoutError:
            raise FusionError(
                f"Sandbox Fusion at {cfg.endpoint} gave no answer within {http_timeout.total:g} s"
            ) from None
        except aiohttp.ClientError as exc:  # a broken answer (its body cut short, ...)
            raise FusionError(
                f"Sandbox Fusion at {cfg.endpoint}: {type(exc).__name__}: {exc}"
            ) from exc
        if status in RETRY_STATUSES:
            raise _Retryable(f"HTTP {status}: {_server_message(body)}")
        if status != 200:
            raise FusionError(
                f"Sandbox Fusion at {cfg.endpoint} answered HTTP {status}: {_server_message(body)}"
            )
        try:
            reply = json.loads(body)
        except ValueError:
            raise FusionError(
                f"Sandbox Fusion at {cfg.endpoint} sent non-JSON: {body[:200]!r}"
            ) from None
        if not isinstance(reply, dict):
            raise FusionError(
                f"Sandbox Fusion at {cfg.endpoint} sent {type(reply).__name__}, not an object"
            )
        return reply


def _run_status(run: Mapping[str, Any], run_timeout: float) -> tuple[SandboxStatus, str]:
    status = run.get("status")
    code = run.get("return_code")
    stderr = str(run.get("stderr") or "")
    if status == "TimeLimitExceeded":
        return "timeout", f"run_timeout {run_timeout:g} s"
    if status == "Finished" and code == 0:
        return "ok", ""
    if looks_like_memory_error(stderr):
        return "memory", "memory limit"
    if status == "Finished":
        return "error", f"exit code {code}"
    return "error", f"run status {status}"


def to_result(
    reply: Mapping[str, Any], duration_s: float, run_timeout: float, endpoint: str
) -> SandboxResult:
    """A Sandbox Fusion reply as a :class:`SandboxResult`; raises on ``SandboxError``."""
    top = reply.get("status")
    if top == "SandboxError" or top not in ("Success", "Failed"):
        raise FusionError(
            f"Sandbox Fusion at {endpoint}: {top}: {reply.get('message') or '(no message)'}"
        )
    compile_result = reply.get("compile_result") or {}
    run = reply.get("run_result") or {}
    if top == "Failed" and compile_result and (not run or compile_result.get("return_code")):
        compile_status = compile_result.get("status")
        status: SandboxStatus = "timeout" if compile_status == "TimeLimitExceeded" else "error"
        return SandboxResult(
            status=status,
            stdout=str(compile_result.get("stdout") or ""),
            stderr=str(compile_result.get("stderr") or ""),
            exit_code=compile_result.get("return_code"),
            duration_s=duration_s,
            detail=f"compile {compile_status}",
        )
    if not run:
        raise FusionError(
            f"Sandbox Fusion at {endpoint}: {top} without run_result: {reply.get('message')}"
        )
    status, detail = _run_status(run, run_timeout)
    stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
    return SandboxResult(
        status=status,
        stdout=stdout,
        stderr=stderr,
        exit_code=run.get("return_code"),
        duration_s=duration_s,
        detail=detail,
        run_s=run.get("execution_time"),
        stdout_bytes=len(stdout.encode()),
        stderr_bytes=len(stderr.encode()),
        isolation={"backend": f"sandbox fusion ({endpoint})"},
    )
