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
    help="Build and locate the built-in tiny model.",
    no_args_is_help=True,
)


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
    table = Table(
        title="built-in model" + (" (cached)" if result.cached else ""), show_header=False
    )
    table.add_row("path", str(result.path))
    table.add_row("hash", result.hash)
    table.add_row("parameters", f"{info['parameters']:,}")
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
    table.add_row("  in the #### format", f"{info['accuracy']:.1%} (what the reward accepts)")
    return table


@model_app.command("init")
def init(
    out: Annotated[
        Path | None, typer.Option(help="Directory to write the model to (default: the cache).")
    ] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if a matching build exists.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the build info as JSON.")] = False,
) -> None:
    """Build the built-in model (tokenizer, SFT on the arithmetic task) deterministically;
    a damaged build is rebuilt."""
    from rich.console import Console

    from tailcut.models.build import ModelRecipe, default_model_dir, ensure_built, recipe_hash
    from tailcut.models.resolve import verify_build

    console = Console(stderr=as_json)
    target = out or default_model_dir()
    problem = verify_build(target, recipe_hash(ModelRecipe())) if target.exists() else None
    if problem is not None and not force:
        console.print(f"[yellow]{target}: {problem}; rebuilding[/yellow]", highlight=False)
    bar, update = _progress_bar()
    with bar:
        result = ensure_built(out=out, force=force, progress=update)
    if as_json:
        typer.echo(json.dumps({"path": str(result.path), "cached": result.cached, **result.info}))
        return
    console.print(_summary(result))


@model_app.command("path")
def path(
    spec: Annotated[str, typer.Argument(help="'builtin' or a model directory.")] = BUILTIN,
) -> None:
    """Print the model directory (building the built-in model if it is missing); a damaged
    one is an error (exit 1)."""
    typer.echo(str(resolve_model(spec)))
