"""``tailcut data``: build and check verl-format parquet datasets.

A command that writes files (gsm8k, convert, arith, dapo-synth) never replaces one that
exists unless given ``--force``. Heavy imports stay inside the commands.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

data_app = typer.Typer(
    name="data",
    help="Build and check verl-format parquet datasets.",
    no_args_is_help=True,
)


Force = Annotated[
    bool, typer.Option(help="Replace output files that exist (else the command refuses).")
]


def _fail(message: str) -> typer.Exit:
    from rich.console import Console

    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(1)


@data_app.command("gsm8k")
def gsm8k(
    src: Annotated[
        Path, typer.Option(help="Folder with GSM8K's train.jsonl and test.jsonl.")
    ] = Path("../shared/data/gsm8k"),
    out: Annotated[
        Path, typer.Option(help="Folder to write train.parquet and test.parquet into.")
    ] = Path("data/gsm8k"),
    system_prompt: Annotated[str | None, typer.Option(help="Replace the system message.")] = None,
    instruction: Annotated[
        str | None, typer.Option(help="Replace the instruction appended to each question.")
    ] = None,
    force: Force = False,
) -> None:
    """Preprocess GSM8K into verl's multi-turn-with-tool layout (calc_gsm8k_reward)."""
    from rich.console import Console

    from tailcut.data import gsm8k as g
    from tailcut.data.verl import DataError

    prompts = g.Prompts(
        system=system_prompt or g.SYSTEM_PROMPT, instruction=instruction or g.INSTRUCTION
    )
    try:
        counts = g.preprocess(src, out, prompts, overwrite=force)
    except DataError as exc:
        raise _fail(str(exc)) from None
    console = Console(soft_wrap=True)
    for split, n in counts.items():
        console.print(f"wrote {out / f'{split}.parquet'}: {n:,} rows")


@data_app.command("convert")
def convert(
    src: Annotated[Path, typer.Argument(help="Input JSONL, one object a line.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output parquet file.")],
    question_field: Annotated[
        str, typer.Option(help="Field (dotted path) with the question.")
    ] = "question",
    answer_field: Annotated[
        str, typer.Option(help="Field (dotted path) with the reference answer.")
    ] = "answer",
    data_source: Annotated[
        str, typer.Option(help="data_source of every row (picks the reward).")
    ] = "math_dapo",
    ability: Annotated[str, typer.Option(help="ability of every row.")] = "math",
    tool: Annotated[
        str,
        typer.Option(help="Tool that gets the ground truth as create_kwargs; 'none' for no tool."),
    ] = "code_interpreter",
    system_prompt: Annotated[str | None, typer.Option(help="Optional system message.")] = None,
    split: Annotated[str, typer.Option(help="extra_info.split of every row.")] = "train",
    skip_bad: Annotated[
        bool, typer.Option(help="Skip and report bad lines instead of failing.")
    ] = False,
    force: Force = False,
) -> None:
    """Convert a question/answer JSONL into DAPO-style verl rows (final line `Answer: X`)."""
    from rich.console import Console

    from tailcut.data.convert import ConvertOptions
    from tailcut.data.convert import convert as run_convert
    from tailcut.data.verl import DataError

    opts = ConvertOptions(
        question_field=question_field,
        answer_field=answer_field,
        data_source=data_source,
        ability=ability,
        tool=None if tool.lower() == "none" else tool,
        system_prompt=system_prompt,
        split=split,
        skip_bad=skip_bad,
    )
    try:
        n, skipped = run_convert(src, out, opts, overwrite=force)
    except DataError as exc:
        raise _fail(str(exc)) from None
    console = Console(soft_wrap=True)
    for p in skipped:
        console.print(f"[yellow]skipped[/yellow] {src}:{p.row}: {p.reason}", highlight=False)
    console.print(
        f"wrote {out}: {n:,} rows" + (f", skipped {len(skipped)} line(s)" if skipped else "")
    )


@data_app.command("check")
def check(
    file: Annotated[Path, typer.Argument(help="A verl-format parquet file.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    limit: Annotated[int, typer.Option(min=1, help="Most problems to print.")] = 200,
) -> None:
    """Validate a verl-format parquet file; list each bad row by index and reason (exit 1 if any)."""
    from tailcut.data.verl import DataError, check_rows, read_rows

    try:
        raw = read_rows(file)
    except DataError as exc:
        if as_json:
            typer.echo(json.dumps({"file": str(file), "ok": False, "error": str(exc)}))
            raise typer.Exit(1) from None
        raise _fail(str(exc)) from None
    good, problems = check_rows(raw)
    errors = [p for p in problems if p.severity == "error"]
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "file": str(file),
                    "ok": not errors,
                    "rows": len(raw),
                    "valid_rows": len(good),
                    "data_sources": dict(Counter(r.data_source for r in good)),
                    "problems": [
                        {"row": p.row, "reason": p.reason, "severity": p.severity} for p in problems
                    ],
                }
            )
        )
    else:
        _print_check(file, len(raw), good, problems, limit)
    if errors:
        raise typer.Exit(1)


def _print_check(file: Path, n_rows: int, good: list, problems: list, limit: int) -> None:
    from rich.console import Console

    console = Console(soft_wrap=True)
    for p in problems[:limit]:
        color = "red" if p.severity == "error" else "yellow"
        console.print(f"[{color}]{p.severity}[/{color}] row {p.row}: {p.reason}", highlight=False)
    if len(problems) > limit:
        console.print(f"... and {len(problems) - limit} more problem(s)")
    bad_rows = len({p.row for p in problems if p.severity == "error"})
    sources = ", ".join(f"{k} ({v:,})" for k, v in Counter(r.data_source for r in good).items())
    verdict = "[green]ok[/green]" if not bad_rows else f"[red]{bad_rows:,} bad row(s)[/red]"
    console.print(
        f"{file}: {n_rows:,} rows, {verdict}" + (f"; data_source: {sources}" if sources else "")
    )


def _report_synth(
    out: Path, counts: dict[str, int], tool: str, problems: Sequence[Any], unit: str
) -> None:
    """Report a synthetic task's written files and its train split's `unit`s per problem."""
    from rich.console import Console

    console = Console(soft_wrap=True)  # paths are never wrapped
    for split, rows in counts.items():
        console.print(f"wrote {out / f'{split}.parquet'}: {rows:,} rows")
    console.print(f"wrote {out / 'tools.yaml'} ({tool})")
    steps = Counter(len(p.steps) for p in problems)
    shares = ", ".join(f"{k}: {steps[k] / len(problems):.0%}" for k in sorted(steps))
    console.print(f"{unit} per problem (train): {shares}", highlight=False)


@data_app.command("arith")
def arith(
    out: Annotated[
        Path, typer.Option(help="Folder for train.parquet, test.parquet and tools.yaml.")
    ] = Path("data/arith"),
    n: Annotated[int, typer.Option(min=1, max=10_000_000, help="Training rows.")] = 5000,
    n_test: Annotated[int, typer.Option(min=1, max=1_000_000, help="Test rows.")] = 500,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the problem generator.")] = 0,
    force: Force = False,
) -> None:
    """Write the built-in model's arithmetic task (calculator tool) as verl-format parquet."""
    from tailcut.data import arith
    from tailcut.data.verl import DataError

    try:
        counts = arith.write_dataset(out, n, n_test, seed, overwrite=force)
    except DataError as exc:
        raise _fail(str(exc)) from None
    problems = arith.generate_problems(arith.split_seed(seed, "train"), n)
    _report_synth(out, counts, f"tool: {arith.TOOL_NAME}", problems, "steps")


@data_app.command("dapo-synth")
def dapo_synth(
    out: Annotated[
        Path, typer.Option(help="Folder for train.parquet, test.parquet and tools.yaml.")
    ] = Path("data/dapo-synth"),
    n: Annotated[int, typer.Option(min=1, max=10_000_000, help="Training rows.")] = 4000,
    n_test: Annotated[int, typer.Option(min=1, max=1_000_000, help="Test rows.")] = 200,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the problem generator.")] = 0,
    max_steps: Annotated[
        int, typer.Option(min=1, max=8, help="Most lines (code calls) of a problem.")
    ] = 6,
    force: Force = False,
) -> None:
    """Write DAPO-layout math problems (DAPO-Math-17k's columns, data_source math_dapo)
    whose answers short Python programs compute, for the code_interpreter tool."""
    from tailcut.data import dapo_synth as ds
    from tailcut.data.verl import DataError

    task = ds.TaskConfig(max_steps=max_steps)
    try:
        counts = ds.write_dataset(out, n, n_test, seed, task, overwrite=force)
    except DataError as exc:
        raise _fail(str(exc)) from None
    problems = ds.generate_problems(ds.split_seed(seed, "train"), n, task)
    _report_synth(out, counts, f"tool: {ds.TOOL_NAME}, local sandbox", problems, "code calls")
