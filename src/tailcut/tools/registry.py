"""Tools from a verl tool-config YAML file, as it is.

```yaml
tools:
  - class_name: verl.tools.gsm8k_tool.Gsm8kTool        # or tailcut.tools.gsm8k.Gsm8kTool
    config: {type: native, timeout: 30}                 # per-call timeout (s), optional
    tool_schema:
      type: function
      function: {name: calc_gsm8k_reward, description: ..., parameters: {...}}
```

verl class names map to tailcut's tools (:data:`VERL_CLASSES`); any other dotted path is
imported (a class with ``from_config(config, tool_schema)``, or a constructor taking
``(config, tool_schema)`` or nothing). ``config`` keys ``type``, ``timeout`` and
``max_concurrency`` are the tool set's; every other key goes to the tool. Errors name the
file and the field (``tools.yaml: tools[1].tool_schema.function.name: ...``).
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tailcut.config import yaml_error_text
from tailcut.errors import TailcutError
from tailcut.tools.base import (
    TIMEOUT_GRACE_S,
    Tool,
    ToolLimits,
    ToolSet,
    default_limits,
    longest_run_s,
)

VERL_CLASSES: dict[str, str] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "tailcut.tools.gsm8k.Gsm8kTool",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "tailcut.tools.code_interpreter.CodeInterpreterTool",
    "verl.tools.sandbox_fusion_tool.SandboxFusionTool": "tailcut.tools.code_interpreter.CodeInterpreterTool",
}  # fmt: skip
TOOLSET_KEYS = ("type", "timeout", "max_concurrency")

TOOLS: dict[str, str] = {
    "calculator": "tailcut.tools.calculator.CalculatorTool",
    "calc_gsm8k_reward": "tailcut.tools.gsm8k.Gsm8kTool",
    "code_interpreter": "tailcut.tools.code_interpreter.CodeInterpreterTool",
}
"""The tool registry: a tool's name → its class, for tools that need no options (what
``data.tools`` and a dataset's ``tools_kwargs`` name; ``code_interpreter`` runs in the local
sandbox with its default limits). Tools with options come from a tool-config file
(:func:`load_tool_config`): Sandbox Fusion with the local sandbox as the fallback is
``class_name: tailcut.tools.code_fallback.FallbackCodeInterpreterTool``."""


class ToolConfigError(TailcutError, ValueError):
    """A tool-config file that cannot be loaded; the message names file and field."""


class FunctionSchema(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionSchema


class ToolEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    class_name: str = Field(min_length=1)
    config: dict[str, Any] = Field(default_factory=dict)
    tool_schema: ToolSchema | None = None


class ToolConfigFile(BaseModel):
    model_config = ConfigDict(extra="allow")

    tools: list[ToolEntry]


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _validation_message(source: str, exc: ValidationError) -> str:
    lines = [f"{source}: invalid tool config:"]
    for err in exc.errors():
        lines.append(f"  {_where(tuple(err['loc']))}: {err['msg']}")
    return "\n".join(lines)


def load_tool_config(path: str | Path) -> ToolSet:
    """The :class:`ToolSet` a verl tool-config YAML file describes."""
    return build_toolset(_read(Path(path)), source=str(path))


def check_tool_config(path: str | Path) -> None:
    """Refuse a tool-config file that cannot load (:class:`ToolConfigError` naming the file
    and the field) without building its tools: it parses, its fields validate, each entry's
    class imports and its ``config.type`` is native. What only a tool's own constructor
    checks (its options) is found by :func:`load_tool_config`."""
    source = str(path)
    spec = _spec(_read(Path(path)), source)
    for i, entry in enumerate(spec.tools):
        where = f"{source}: tools[{i}]"
        resolve_class(entry.class_name, where)
        _check_native(entry.config, where)


def _read(path: Path) -> Any:
    """The YAML a tool-config file holds; a parse error is ``file:line:col: ...``."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ToolConfigError(f"tool config {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ToolConfigError(
            f"{path}: not UTF-8 text (byte {exc.start}): is it a YAML file?"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ToolConfigError(yaml_error_text(path, text, exc)) from None


def _spec(raw: Any, source: str) -> ToolConfigFile:
    try:
        return ToolConfigFile.model_validate(raw)
    except ValidationError as exc:
        raise ToolConfigError(_validation_message(source, exc)) from None


def build_toolset(raw: Any, *, source: str = "tool config") -> ToolSet:
    spec = _spec(raw, source)
    tools: dict[str, Tool] = {}
    limits: dict[str, ToolLimits] = {}
    for i, entry in enumerate(spec.tools):
        where = f"{source}: tools[{i}]"
        tool, lim = _build_one(entry, where)
        if tool.name in tools:
            raise ToolConfigError(
                f"{where}.tool_schema.function.name: tool {tool.name!r} is defined twice"
            )
        tools[tool.name], limits[tool.name] = tool, lim
    return ToolSet(tools, limits)


def _check_native(config: Mapping[str, Any], where: str) -> None:
    kind = config.get("type", "native")
    if kind != "native":
        raise ToolConfigError(
            f"{where}.config.type: only 'native' tools are supported, got {kind!r}"
        )


def _limits(config: Mapping[str, Any], where: str, default: ToolLimits) -> ToolLimits:
    """``default`` (the tool's :func:`~tailcut.tools.base.default_limits`) with what the
    config sets instead."""
    timeout, concurrency = default.timeout_s, default.max_concurrency
    for key in ("timeout", "max_concurrency"):
        if key not in config:
            continue
        raw = config[key]
        try:
            value = float(raw) if not isinstance(raw, bool) else math.nan
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise ToolConfigError(f"{where}.config.{key}: expected a number > 0, got {raw!r}")
        if key == "timeout":
            timeout = value
        elif value != int(value):
            raise ToolConfigError(f"{where}.config.{key}: expected a whole number, got {raw!r}")
        else:
            concurrency = int(value)
    return ToolLimits(timeout_s=timeout, max_concurrency=concurrency)


def tools_by_name(names: Iterable[str]) -> ToolSet:
    """A tool set of the named registered tools (:data:`TOOLS`), with default limits."""
    tools: dict[str, Tool] = {}
    for name in names:
        if name not in TOOLS:
            raise ToolConfigError(f"tool {name!r} is not one of {', '.join(TOOLS)}")
        tools[name] = resolve_class(TOOLS[name], f"tool {name!r}")()
    return ToolSet(tools)


def resolve_class(class_name: str, where: str) -> type:
    target = VERL_CLASSES.get(class_name, class_name)
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise ToolConfigError(f"{where}.class_name: {class_name!r} is not a dotted path")
    if target.startswith("verl."):
        known = ", ".join(VERL_CLASSES)
        raise ToolConfigError(
            f"{where}.class_name: verl class {class_name!r} has no tailcut counterpart; known: {known}"
        )
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise ToolConfigError(f"{where}.class_name: cannot import {target!r}: {exc}") from None
    if not isinstance(cls, type):
        raise ToolConfigError(f"{where}.class_name: {target!r} is not a class")
    return cls


def _instantiate(
    cls: type, config: dict[str, Any], schema: dict[str, Any] | None, where: str
) -> Any:
    try:
        if hasattr(cls, "from_config"):
            return cls.from_config(config, schema)
        if not inspect.signature(cls).parameters:
            if config:
                raise ValueError(f"{cls.__name__} takes no options, got {', '.join(config)}")
            return cls()
        return cls(config, schema)
    except ValidationError as exc:
        errs = "; ".join(f"{_where(tuple(e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ToolConfigError(f"{where}.config: {errs}") from None
    except (TypeError, ValueError) as exc:
        raise ToolConfigError(f"{where}.config: {exc}") from None


def _build_one(entry: ToolEntry, where: str) -> tuple[Tool, ToolLimits]:
    cls = resolve_class(entry.class_name, where)
    _check_native(entry.config, where)
    tool_config = {k: v for k, v in entry.config.items() if k not in TOOLSET_KEYS}
    schema = entry.tool_schema.model_dump(exclude_none=True) if entry.tool_schema else None
    tool = _instantiate(cls, tool_config, schema, where)
    if not isinstance(tool, Tool):
        raise ToolConfigError(
            f"{where}.class_name: {entry.class_name!r} does not implement the Tool protocol"
        )
    if schema is not None and tool.name != schema["function"]["name"]:
        raise ToolConfigError(
            f"{where}.tool_schema.function.name: {schema['function']['name']!r} does not match "
            f"the tool's own name {tool.name!r}"
        )
    lim = _limits(entry.config, where, default_limits(tool))
    bound = longest_run_s(tool)
    if bound is not None and "timeout" in entry.config and lim.timeout_s <= bound:
        raise ToolConfigError(
            f"{where}.config.timeout: {lim.timeout_s:g} s is not above the longest run the tool "
            f"allows itself ({bound:g} s): its own time-out, and the output a program had, "
            f"would be lost to this one; set it above, e.g. {bound + TIMEOUT_GRACE_S:g}"
        )
    return tool, lim
