"""``tailcut model``: build and locate the built-in model (``models/resolve.py`` resolves)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tailcut.models.resolve import BUILTIN, resolve_model

if TYPE_CHECKING:
    from tailcut.models.build import BuildResult, Progress

model_app = typer.Typer(
    name="model",
    help="Build and locate the built-in tiny models (default: calculator; code: code interpreter).",
    no_args_is_help=True,
)
VARIANT_NAMES = ("arith", "code", "qwen2-0.5b", "qwen2-1.5b", "qwen2-3b")
"""``--variant`` choices: the keys of ``models/build.VARIANTS``."""


def _progress_bar() -> tuple[Any, Progress]:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("[bold]{task.description:<9}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(), transient=True, console=Console(stderr=True),
    )  # fmt: skip
    tasks: dict[str, Any] = {}

    def update(phase: str, fraction: float) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=1.0)
        bar.update(tasks[phase], completed=fraction)

    return bar, update


def _summary(result: BuildResult) -> Any:
    from rich.table import Table

    info = result.info
    variant = info["recipe"].get("variant", "arith")
    title = "built-in model" + ("" if variant == "arith" else f" ({variant} variant)")
    table = Table(title=title + (" (cached)" if result.cached else ""), show_header=False)
    table.add_row("path", str(result.path))
    table.add_row("hash", result.hash)
    table.add_row("parameters", f"{info['parameters']:,}")
    if info["recipe"].get("random_init"):  # a size preset: random weights, nothing trained
        table.add_row(
            "vocabulary", f"{info['vocab_size']:,} rows, {info['tokenizer_rows']} sampled"
        )
        table.add_row("build time", f"{info['build_seconds']:.0f} s")
        return table
    table.add_row(
        "build time", f"{info['build_seconds']:.0f} s" + (" (earlier)" if result.cached else "")
    )
    table.add_row("final SFT loss", f"{info['final_loss']:.3f}")
    table.add_row(
        "greedy accuracy",
        f"{info['accuracy_any_format']:.1%} on {info['recipe']['eval_problems']} held-out "
        "problems (answer right, either format)",
    )
    for row in info["accuracy_any_format_by_steps"]:
        table.add_row(f"  {row['steps']} step(s)", f"{row['accuracy']:.1%} (n={row['n']})")
    fmt = "Answer: N" if variant == "code" else "####"
    table.add_row(f"  in the {fmt} format", f"{info['accuracy']:.1%} (what the reward accepts)")
    if "tool_calls_run_share" in info:
        table.add_row(
            "tool calls of the task's form",
            f"{info['tool_calls_run_share']:.1%} of {info['tool_calls']:,} greedy calls",
        )
    return table


@model_app.command("init")
def init(
    out: Annotated[
        Path | None, typer.Option(help="Directory to write the model to (default: the cache).")
    ] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if a matching build exists.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the build info as JSON.")] = False,
    variant: Annotated[
        str,
        typer.Option(
            help="arith: SFT on calculator calls (model spec 'builtin'); code: on "
            "code_interpreter calls for DAPO-layout problems ('builtin-code'); qwen2-0.5b, "
            "qwen2-1.5b, qwen2-3b: random-init Qwen2 sizes with a 151,936-row vocabulary and "
            "the built-in tokenizer ('builtin-qwen2-0.5b', '-1.5b', '-3b')."
        ),
    ] = "arith",
) -> None:
    """Build a built-in model (tokenizer, SFT on its task) deterministically; a damaged
    build is rebuilt."""
    from rich.console import Console

    from tailcut.models.build import (
        VARIANTS,
        check_replaceable,
        default_model_dir,
        ensure_built,
        recipe_hash,
    )
    from tailcut.models.resolve import verify_build

    if variant not in VARIANT_NAMES:
        raise typer.BadParameter(
            f"{variant!r} is not one of {', '.join(VARIANT_NAMES)}", param_hint="--variant"
        )
    recipe = VARIANTS[variant]
    console = Console(stderr=as_json)
    target = out or default_model_dir(recipe)
    check_replaceable(target)
    problem = verify_build(target, recipe_hash(recipe)) if target.exists() else None
    if problem is not None and not force:
        console.print(f"[yellow]{target}: {problem}; rebuilding[/yellow]", highlight=False)
    bar, update = _progress_bar()
    with bar:
        result = ensure_built(recipe, out=out, force=force, progress=update)
    if as_json:
        typer.echo(json.dumps({"path": str(result.path), "cached": result.cached, **result.info}))
        return
    console.print(_summary(result))


@model_app.command("path")
def path(
    spec: Annotated[
        str, typer.Argument(help="'builtin', 'builtin-code' or a model directory.")
    ] = BUILTIN,
) -> None:
    """Print the model directory (building the built-in model if it is missing); a damaged
    one is an error (exit 1)."""
    typer.echo(str(resolve_model(spec)))
