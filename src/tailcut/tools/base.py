"""The Tool protocol (create → execute → calc_reward → release) and the per-sample session.

A :class:`Tool` is what a user writes. A :class:`ToolSet` holds the configured tools with
their per-call timeout and concurrency limit. The agent loop opens one
:class:`ToolSession` per trajectory (``async with toolset.session(...)``); the session
creates the sample's tool instances lazily, turns every failure of a call (unknown tool,
bad arguments, timeout, exception) into an error message for the model, and always
releases what it created — also when the trajectory is cancelled by a cut.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable


@dataclass(slots=True)
class ToolResult:
    text: str
    """What the model reads as the tool message."""
    status: str = "ok"
    """ok | error | timeout | unknown_tool | bad_arguments (tools may add their own)."""
    step_reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def is_error(self) -> bool:
        return self.status != "ok"


@runtime_checkable
class Tool(Protocol):
    name: str

    def schema(self) -> dict[str, Any]:
        """OpenAI function schema: ``{"type": "function", "function": {...}}``."""
        ...

    async def create(self, instance_id: str, **create_kwargs: Any) -> None: ...

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult: ...

    async def calc_reward(self, instance_id: str) -> float: ...

    async def release(self, instance_id: str) -> None: ...


DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class ToolLimits:
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_concurrency: int = 64


TIMEOUT_GRACE_S = 10.0
"""How far a call's time-out lies past the longest run a tool allows itself."""


def longest_run_s(tool: Tool) -> float | None:
    """The longest a call of ``tool`` runs by its own limits (``longest_run_s``: a code
    interpreter's wall-clock bound), None when it has none."""
    bound = getattr(tool, "longest_run_s", None)
    return float(bound) if isinstance(bound, int | float) else None


def default_limits(tool: Tool) -> ToolLimits:
    """A tool's limits when its config gives none: a time-out past its own longest run, so
    that the tool's own verdict (a program's "timed out" and the output it had) reaches the
    model, not this guard's; no more calls at once than it runs at once (``parallel_runs``:
    a sandbox's slots), so that a call waits for its turn before its time-out starts, not
    inside it."""
    bound = longest_run_s(tool)
    runs = getattr(tool, "parallel_runs", None)
    out = ToolLimits()
    if bound is not None:
        out = replace(out, timeout_s=max(DEFAULT_TIMEOUT_S, bound + TIMEOUT_GRACE_S))
    if isinstance(runs, int) and runs < out.max_concurrency:
        out = replace(out, max_concurrency=runs)
    return out


class ToolSet:
    """The configured tools of a run, each with its limits."""

    def __init__(self, tools: Mapping[str, Tool], limits: Mapping[str, ToolLimits] | None = None):
        self.tools = dict(tools)
        given = limits or {}
        self.limits = {n: given.get(n) or default_limits(t) for n, t in self.tools.items()}
        self._slots = {n: asyncio.Semaphore(lim.max_concurrency) for n, lim in self.limits.items()}

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.tools.values()]

    async def aclose(self) -> None:
        """Close tools that hold run-wide resources (HTTP sessions, worker processes):
        those with an ``aclose()`` method, each even when one before it raises."""
        closers = [getattr(tool, "aclose", None) for tool in self.tools.values()]
        await _each([c for c in closers if c is not None])

    @asynccontextmanager
    async def session(
        self, instance_id: str, create_kwargs: Mapping[str, Mapping[str, Any]] | None = None
    ) -> AsyncIterator[ToolSession]:
        session = ToolSession(self, instance_id, dict(create_kwargs or {}))
        try:
            yield session
        finally:
            # Shielded: a cut must not leave tool resources behind.
            await asyncio.shield(session.release_all())


class ToolSession:
    def __init__(self, toolset: ToolSet, instance_id: str, create_kwargs: dict[str, Any]):
        self.toolset = toolset
        self.instance_id = instance_id
        self.create_kwargs = create_kwargs
        self.created: list[str] = []
        """Tools whose instance was asked for, in order (released at the end, also after a
        creation that failed half-way: release must undo what it left)."""
        self._creations: dict[str, asyncio.Future[None]] = {}
        self.calls = 0
        self.errors = 0

    async def _ensure(self, name: str) -> None:
        """The tool's instance exists: a turn's concurrent first calls of one tool share
        one creation (none executes before it is done); a call that times out leaves it
        running for the others (shielded), a failed one fails each of them."""
        creation = self._creations.get(name)
        if creation is None:
            kwargs = self.create_kwargs.get(name) or {}
            self.created.append(name)
            creation = asyncio.ensure_future(
                self.toolset.tools[name].create(self.instance_id, **kwargs)
            )
            self._creations[name] = creation
        await asyncio.shield(creation)

    async def call(self, name: str, arguments: Any) -> ToolResult:
        """Run one tool call; never raises except CancelledError."""
        self.calls += 1
        started = time.monotonic()
        result = await self._call(name, arguments)
        result.duration_s = time.monotonic() - started
        if result.is_error:
            self.errors += 1
        return result

    async def _call(self, name: str, arguments: Any) -> ToolResult:
        tool = self.toolset.tools.get(name)
        if tool is None:
            known = ", ".join(sorted(self.toolset.tools)) or "none"
            return ToolResult(f"Error: unknown tool {name!r}; available: {known}.", "unknown_tool")
        if not isinstance(arguments, dict):
            return ToolResult(
                f"Error: arguments of {name} must be a JSON object, got {json.dumps(arguments)[:200]}.",
                "bad_arguments",
            )
        limits = self.toolset.limits[name]
        try:
            async with self.toolset._slots[name], asyncio.timeout(limits.timeout_s):
                await self._ensure(name)
                return await tool.execute(self.instance_id, arguments)
        except TimeoutError:
            return ToolResult(f"Error: {name} timed out after {limits.timeout_s:g} s.", "timeout")
        except (TypeError, ValueError, KeyError) as exc:
            return ToolResult(f"Error: bad arguments for {name}: {exc}", "bad_arguments")
        except Exception as exc:  # a tool bug must not kill the trajectory
            return ToolResult(f"Error: {name} failed: {type(exc).__name__}: {exc}", "error")

    async def rewards(self) -> dict[str, float]:
        return {
            name: await self.toolset.tools[name].calc_reward(self.instance_id)
            for name in self.created
        }

    async def release_all(self) -> None:
        """Release every tool created in this session (a creation still running once it
        ends); a release that raises does not keep the others from theirs: the first error
        is raised after all of them."""
        tools = [self.toolset.tools[name] for name in reversed(self.created)]
        running = list(self._creations.values())
        self.created.clear()
        self._creations.clear()
        await asyncio.gather(*running, return_exceptions=True)
        await _each([functools.partial(tool.release, self.instance_id) for tool in tools])


async def _each(calls: Sequence[Callable[[], Awaitable[None]]]) -> None:
    """Await every call in order; one that raises does not keep the others from running:
    the first error is raised after all of them."""
    errors: list[Exception] = []
    for call in calls:
        try:
            await call()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
