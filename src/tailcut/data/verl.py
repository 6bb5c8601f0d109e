"""verl-format datasets: the row schema, parquet I/O, validation and the prompt loader.

A verl-format parquet file holds one prompt a row::

    data_source   str                      which reward function scores it ("openai/gsm8k")
    prompt        list[{role, content}]    the chat messages given to the policy
    ability       str (optional)           "math", ...
    agent_name    str (optional)           "tool_agent" for multi-turn rows with tools
    reward_model  {style, ground_truth}    ground truth: a non-empty string (or a number)
    extra_info    struct (optional)        split, index, need_tools_kwargs,
                                           tools_kwargs.{tool}.create_kwargs, interaction_kwargs

Other columns are ignored. Files written by verl (through HF ``datasets``) store dicts as
Arrow structs whose fields are the union over all rows, so a key a row did not have reads
back as ``None``: here ``None`` always means "absent".

:func:`load_prompts` turns a file into typed :class:`PromptRow` values; a bad row (empty
prompt, missing ground truth, prompt over the token limit, ...) is either an error that
names every bad row, or a reported, skipped row (``on_bad_row="skip"``).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tailcut.errors import TailcutError

log = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
OPTIONAL_COLUMNS = ("ability", "agent_name", "extra_info")
KNOWN_COLUMNS = REQUIRED_COLUMNS + OPTIONAL_COLUMNS
ROLES = frozenset({"system", "user", "assistant", "tool"})
TOOL_KWARGS_KEYS = frozenset(
    {"create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs"}
)
NUMERIC_SOURCES = frozenset({"openai/gsm8k"})
"""Data sources whose ground truth must be a number."""
_NUMBER = re.compile(r"^-?[0-9][0-9,]*(\.[0-9]+)?$|^-?\.[0-9]+$")

CountTokens = Callable[[Sequence[Mapping[str, Any]]], int]
"""Counts the prompt tokens of a message list (the caller applies its chat template)."""


class DataError(TailcutError, ValueError):
    """A dataset file that cannot be used; the message names the file, rows and reasons."""


@dataclass(frozen=True, slots=True)
class RowProblem:
    row: int
    """Position of the row in the file (0-based)."""
    reason: str
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        return f"row {self.row}: {self.reason}"


@dataclass(frozen=True, slots=True)
class PromptRow:
    """One validated prompt, as rollouts and training consume it."""

    row: int
    """Position in the file (0-based)."""
    index: int | str
    """``extra_info.index`` when present (an int or an id string), else ``row``."""
    messages: list[dict[str, Any]]
    ground_truth: str
    data_source: str
    ability: str | None = None
    agent_name: str | None = None
    reward_style: str | None = None
    tools_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per tool: ``create_kwargs`` / ``execute_kwargs`` / ``calc_reward_kwargs`` / ``release_kwargs``."""
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    extra_info: dict[str, Any] = field(default_factory=dict)

    @property
    def create_kwargs(self) -> dict[str, dict[str, Any]]:
        """``{tool: create_kwargs}``, the shape ``ToolSet.session`` takes."""
        return {name: dict(kw.get("create_kwargs") or {}) for name, kw in self.tools_kwargs.items()}

    def as_data(self) -> dict[str, object]:
        """The row as ``Sample.data``: the fields above, and verl's own columns (``prompt``,
        ``reward_model``, ``extra_info``) that reward functions read. The one row → sample
        conversion: rollouts and training both use it."""
        return {
            "index": self.index,
            "messages": self.messages,
            "ground_truth": self.ground_truth,
            "data_source": self.data_source,
            "ability": self.ability,
            "agent_name": self.agent_name,
            "tools_kwargs": self.tools_kwargs,
            "interaction_kwargs": self.interaction_kwargs,
            "prompt": self.messages,
            "reward_model": {
                "style": self.reward_style or "rule",
                "ground_truth": self.ground_truth,
            },
            "extra_info": self.extra_info,
        }


@dataclass(slots=True)
class PromptSet:
    """The rows of a file that passed validation, and the problems of those that did not."""

    path: Path
    rows: list[PromptRow]
    skipped: list[RowProblem] = field(default_factory=list)
    """One per bad row left out: its problems' reasons, joined with "; "."""
    warnings: list[RowProblem] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[PromptRow]:
        return iter(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        return self.rows[i]


# -- parquet I/O ---------------------------------------------------------------------------


def check_not_input(out: Path, inputs: Iterable[Path]) -> None:
    """Refuse an output path that is one of the (existing) inputs: the same path, a link to
    it or a hard link; raises ``DataError`` naming both."""
    for src in inputs:
        if os.path.exists(out) and os.path.samefile(out, src):
            raise DataError(f"{out}: the output is the input {src}; choose another output path")


def check_overwrite(paths: Iterable[Path], overwrite: bool) -> None:
    """Refuse to replace output files that exist unless ``overwrite`` (``--force``): a data
    command never replaces a file silently. Raises ``DataError`` naming them (a path that is
    a directory is left to the write, which names it)."""
    if overwrite:
        return
    existing = [
        Path(p) for p in paths if os.path.islink(p) or (os.path.exists(p) and not os.path.isdir(p))
    ]
    if not existing:
        return
    how = "pass --force, or choose another --out"
    if len(existing) == 1:
        raise DataError(f"{existing[0]} exists; refusing to replace it: {how}")
    names = ", ".join(p.name for p in existing)
    raise DataError(f"{existing[0].parent}: {names} exist; refusing to replace them: {how}")


def write_rows(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Write dict rows as a parquet file (nested dicts become Arrow structs), atomically: into
    a temporary file next to ``path``, renamed over it once complete, so a failed write
    leaves no partial file and an existing ``path`` as it was."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not rows:
        raise DataError(f"{path}: refusing to write an empty dataset")
    try:
        table = pa.Table.from_pylist(list(rows))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise DataError(f"{path}: rows do not form one Arrow schema: {exc}") from None
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except pa.ArrowNotImplementedError as exc:
        # e.g. an empty dict in every row: Arrow cannot store a struct with no field.
        raise DataError(f"{path}: cannot store these rows in parquet: {exc}") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot write ({exc.strerror or exc})") from None
    finally:
        if tmp.exists():  # False too where the folder could not be made
            tmp.unlink()


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Read the known columns of a verl-format parquet file as dicts (extra columns dropped).

    Raises ``DataError`` when the file is missing, not parquet, damaged, lacks a required
    column or has no rows.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty (0 bytes)")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError):
        raise DataError(
            f"{path}: not a readable parquet file (its footer is missing or damaged)"
        ) from None
    with pf:
        names = pf.schema_arrow.names
        missing = [c for c in REQUIRED_COLUMNS if c not in names]
        if missing:
            raise DataError(
                f"{path}: missing column(s) {missing}; a verl-format file needs "
                f"{list(REQUIRED_COLUMNS)} (found {names})"
            )
        if pf.metadata.num_rows == 0:
            raise DataError(f"{path}: no rows (an empty dataset)")
        columns = {}
        for name in (c for c in KNOWN_COLUMNS if c in names):
            try:
                columns[name] = pf.read(columns=[name]).column(0)
            except (pa.ArrowException, OSError):
                raise DataError(
                    f"{path}: column {name!r} cannot be read: the file is damaged "
                    "(truncated or overwritten); write it again"
                ) from None
    return pa.table(columns).to_pylist()


# -- validation ----------------------------------------------------------------------------


def _mapping(value: Any) -> dict[str, Any] | None:
    """A dict from a struct (dict) or an Arrow map (list of pairs); None if neither."""
    if isinstance(value, dict):
        return value
    if isinstance(value, list) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        return dict(value)
    return None


def _present(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _check_messages(prompt: Any) -> tuple[list[dict[str, Any]], list[str]]:
    if prompt is None:
        return [], ["prompt is missing"]
    if not isinstance(prompt, list | tuple):
        return [], [
            f"prompt must be a list of {{role, content}} messages, got {type(prompt).__name__}"
        ]
    if not prompt:
        return [], ["prompt is empty (no messages)"]
    messages: list[dict[str, Any]] = []
    problems: list[str] = []
    for j, raw in enumerate(prompt):
        msg = _mapping(raw)
        if msg is None:
            problems.append(f"prompt[{j}] is not a message object")
            continue
        msg = _present(msg)
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            problems.append(f"prompt[{j}].role is {role!r}; expected one of {sorted(ROLES)}")
        if not isinstance(content, str):
            problems.append(f"prompt[{j}].content must be a string, got {type(content).__name__}")
        messages.append(msg)
    if not problems:
        if all(not m["content"].strip() for m in messages):
            problems.append("prompt is empty (every message has empty content)")
        elif not any(m["role"] == "user" and m["content"].strip() for m in messages):
            problems.append("prompt has no non-empty user message")
    return messages, problems


def _check_ground_truth(reward_model: Any, data_source: Any) -> tuple[str, str | None, list[str]]:
    rm = _mapping(reward_model)
    if rm is None:
        return "", None, ["reward_model must be an object with ground_truth"]
    style = rm.get("style")
    gt = rm.get("ground_truth")
    if gt is None:
        return "", style, ["reward_model.ground_truth is missing"]
    if isinstance(gt, bool) or not isinstance(gt, str | int | float):
        return (
            "",
            style,
            [f"reward_model.ground_truth must be a string or number, got {type(gt).__name__}"],
        )
    if isinstance(gt, float) and gt.is_integer():
        gt = int(gt)  # a numeric parquet column stores 72 as 72.0: its answer is "72"
    text = str(gt).strip()
    if not text:
        return "", style, ["reward_model.ground_truth is empty"]
    if data_source in NUMERIC_SOURCES and not _NUMBER.match(text):
        return text, style, [f"reward_model.ground_truth {text!r} is not a number ({data_source})"]
    return text, style, []


def _check_tools(
    extra: dict[str, Any],
) -> tuple[dict[str, dict[str, Any]], list[RowProblem | str]]:
    raw = extra.get("tools_kwargs")
    if raw is None:
        return {}, []
    tk = _mapping(raw)
    if tk is None:
        return {}, [f"extra_info.tools_kwargs must be an object, got {type(raw).__name__}"]
    tools: dict[str, dict[str, Any]] = {}
    problems: list[RowProblem | str] = []
    for name, kwargs in _present(tk).items():
        kw = _mapping(kwargs)
        if kw is None:
            problems.append(f"extra_info.tools_kwargs.{name} must be an object")
            continue
        kw = _present(kw)
        for key in sorted(kw.keys() - TOOL_KWARGS_KEYS):
            msg = f"extra_info.tools_kwargs.{name} has unknown key {key!r} (ignored)"
            problems.append(RowProblem(-1, msg, "warning"))
        clean: dict[str, Any] = {}
        for key in sorted(kw.keys() & TOOL_KWARGS_KEYS):
            sub = _mapping(kw[key])
            if sub is None:
                problems.append(f"extra_info.tools_kwargs.{name}.{key} must be an object")
            else:
                clean[key] = _present(sub)
        tools[name] = clean
    return tools, problems


def _check_extra(
    raw: Any,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], list[RowProblem | str]]:
    if raw is None:
        return {}, {}, []
    extra = _mapping(raw)
    if extra is None:
        return {}, {}, [f"extra_info must be an object, got {type(raw).__name__}"]
    extra = _present(extra)
    tools, problems = _check_tools(extra)
    out: list[RowProblem | str] = list(problems)
    index = extra.get("index")
    if index is not None and (isinstance(index, bool) or not isinstance(index, int | str)):
        out.append(f"extra_info.index must be an int or a string, got {type(index).__name__}")
    need = extra.get("need_tools_kwargs")
    if need is not None and not isinstance(need, bool):
        out.append(f"extra_info.need_tools_kwargs must be a bool, got {type(need).__name__}")
    elif need and not tools and not any(isinstance(p, str) for p in problems):
        out.append(RowProblem(-1, "need_tools_kwargs is true but tools_kwargs is empty", "warning"))
    ik = extra.get("interaction_kwargs")
    if ik is not None and _mapping(ik) is None:
        out.append("extra_info.interaction_kwargs must be an object")
    return extra, tools, out


def _check_text(row: Mapping[str, Any], key: str, required: bool) -> tuple[str | None, list[str]]:
    value = row.get(key)
    if value is None:
        return None, [f"{key} is missing"] if required else []
    if not isinstance(value, str) or (required and not value.strip()):
        return None, [f"{key} must be a non-empty string, got {value!r}"]
    return value, []


def parse_row(raw: Mapping[str, Any], row: int) -> tuple[PromptRow | None, list[RowProblem]]:
    """Validate one row; return the typed row (None on any error) and every problem found."""
    found: list[RowProblem | str] = []
    data_source, p = _check_text(raw, "data_source", True)
    found += p
    ability, p = _check_text(raw, "ability", False)
    found += p
    agent_name, p = _check_text(raw, "agent_name", False)
    found += p
    messages, p = _check_messages(raw.get("prompt"))
    found += p
    gt, style, p = _check_ground_truth(raw.get("reward_model"), data_source)
    found += p
    extra, tools, pe = _check_extra(raw.get("extra_info"))
    found += pe
    problems = [
        RowProblem(row, f.reason, f.severity) if isinstance(f, RowProblem) else RowProblem(row, f)
        for f in found
    ]
    if any(pr.severity == "error" for pr in problems):
        return None, problems
    index = extra.get("index")
    parsed = PromptRow(
        row=row,
        index=index if isinstance(index, int | str) else row,
        messages=messages,
        ground_truth=gt,
        data_source=data_source or "",
        ability=ability,
        agent_name=agent_name,
        reward_style=style if isinstance(style, str) else None,
        tools_kwargs=tools,
        interaction_kwargs=_present(_mapping(extra.get("interaction_kwargs")) or {}),
        extra_info=extra,
    )
    return parsed, problems


def sample_data(raw: Mapping[str, Any], row: int) -> dict[str, object]:
    """A verl row (as written to parquet) as ``Sample.data``: validated, then
    :meth:`PromptRow.as_data`; a row with an error raises :class:`DataError` naming it."""
    parsed, problems = parse_row(raw, row)
    if parsed is None:
        raise DataError(format_problems([p for p in problems if p.severity == "error"]))
    return parsed.as_data()


def check_rows(
    rows: Sequence[Mapping[str, Any]],
    *,
    max_prompt_tokens: int | None = None,
    count_tokens: CountTokens | None = None,
) -> tuple[list[PromptRow], list[RowProblem]]:
    """Validate every row; return the good rows and all problems (errors and warnings)."""
    if max_prompt_tokens is not None and count_tokens is None:
        raise ValueError("max_prompt_tokens needs count_tokens (a function of the prompt messages)")
    good: list[PromptRow] = []
    problems: list[RowProblem] = []
    for i, raw in enumerate(rows):
        parsed, found = parse_row(raw, i)
        if parsed is not None and max_prompt_tokens is not None and count_tokens is not None:
            n = count_tokens(parsed.messages)
            if n > max_prompt_tokens:
                found.append(
                    RowProblem(i, f"prompt has {n} tokens, over the limit of {max_prompt_tokens}")
                )
                parsed = None
        problems += found
        if parsed is not None:
            good.append(parsed)
    return good, problems


def bad_rows(problems: Iterable[RowProblem]) -> list[RowProblem]:
    """One error per bad row, in the order found, with all its errors' reasons ("; ")."""
    reasons: dict[int, list[str]] = {}
    for p in problems:
        if p.severity == "error":
            reasons.setdefault(p.row, []).append(p.reason)
    return [RowProblem(row, "; ".join(found)) for row, found in reasons.items()]


def format_problems(problems: Sequence[RowProblem], limit: int = 20) -> str:
    lines = [f"  {p}" for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"  ... and {len(problems) - limit} more")
    return "\n".join(lines)


def load_prompts(
    path: Path | str,
    max_prompt_tokens: int | None = None,
    on_bad_row: Literal["error", "skip"] = "error",
    *,
    count_tokens: CountTokens | None = None,
) -> PromptSet:
    """Load a verl-format parquet file as typed prompt rows.

    A bad row (empty prompt, missing or malformed ground truth, prompt longer than
    ``max_prompt_tokens`` as counted by ``count_tokens``) raises ``DataError`` naming every
    bad row with ``on_bad_row="error"``; with ``"skip"`` it is left out, logged, and listed
    in ``PromptSet.skipped``. A bad row is counted and listed once, with all its problems.
    Warnings never drop a row.
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    path = Path(path)
    rows, problems = check_rows(
        read_rows(path), max_prompt_tokens=max_prompt_tokens, count_tokens=count_tokens
    )
    errors = bad_rows(problems)  # a row with several problems is one bad row
    warnings = [p for p in problems if p.severity == "warning"]
    if errors and on_bad_row == "error":
        raise DataError(f"{path}: {len(errors)} bad row(s):\n{format_problems(errors)}")
    for p in errors:
        log.warning("%s: skipping %s", path, p)
    if not rows:
        detail = f" ({len(errors)} bad row(s)):\n{format_problems(errors)}" if errors else ""
        raise DataError(f"{path}: no usable rows{detail}")
    return PromptSet(path=path, rows=rows, skipped=errors, warnings=warnings)
