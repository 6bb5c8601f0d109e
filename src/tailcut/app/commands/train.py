"""``tailcut train CONFIG.yaml [key=value ...]``: the GRPO training job."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from tailcut.train.config import TrainConfig
    from tailcut.train.trainer import TrainSummary


def train(
    config: Annotated[Path | None, typer.Argument(help="YAML config (see configs/).")] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="Dotted key=value overrides, e.g. cutoff.policy=deadline."),
    ] = None,
) -> None:
    """Train a policy with GRPO on over-sampled, cut-off multi-turn rollouts."""
    import asyncio

    from rich.console import Console

    from tailcut.config import ConfigError
    from tailcut.train.config import load_train_config

    console = Console()
    items = list(overrides or [])
    if config is not None and "=" in config.name and not config.exists():
        items.insert(0, str(config))  # `tailcut train key=value` without a file
        config = None
    try:
        cfg = load_train_config(config, items)
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    summary = asyncio.run(_run(cfg, console))
    _print_summary(console, summary)


async def _run(cfg: TrainConfig, console: Console) -> TrainSummary:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tailcut.app.train_setup import build_setup
    from tailcut.train.plots import plot_run
    from tailcut.train.trainer import Trainer

    console.print(f"[bold]tailcut train[/bold] → {cfg.trainer.run_dir}")
    setup = build_setup(cfg)
    trainer = Trainer(cfg, setup, console=console)
    columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("steps", total=cfg.trainer.steps)
            summary = await trainer.run(lambda k, n: bar.update(task, completed=k))
    finally:
        if setup.close is not None:
            await setup.close()
    plot_run(summary.run_dir)
    return summary


def _print_summary(console: Console, summary: TrainSummary) -> None:
    from rich.table import Table

    run = summary.run_dir
    table = Table(title="tailcut train: done", show_header=False)
    table.add_row("steps", str(summary.steps_done))
    if summary.resumed_from is not None:
        table.add_row("resumed from step", str(summary.resumed_from))
    if summary.final_val_reward is not None:
        table.add_row("final val reward", f"{summary.final_val_reward:.3f}")
    table.add_row("wall time", f"{summary.wall_s:.0f} s")
    table.add_row("config", str(run / "config.yaml"))
    table.add_row("metrics", str(run / "metrics.jsonl"))
    table.add_row("traces", str(run / "traces"))
    table.add_row("checkpoints", str(run / "checkpoints"))
    table.add_row("plots", str(run / "plots"))
    console.print(table)
