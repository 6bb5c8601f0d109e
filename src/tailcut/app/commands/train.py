"""``tailcut train CONFIG.yaml [key=value ...]``: the GRPO training job.

Errors come out through the CLI's boundary (``app/cli.py``): a bad config or run directory
exits 2 before the model is loaded. SIGINT and SIGTERM cancel the run (its ``finally``
blocks close the metrics file, workers and engine) and exit 130 / 143 with one line; the
same command continues from the last checkpoint.

``TAILCUT_FAULT=STEP:PHASE:SIGNAL`` (crash tests only; ``TAILCUT_FAULT_RANK=R``: in rank R
of a job only) makes the run send itself SIGNAL (INT, TERM or KILL) at PHASE of STEP, a phase of ``Trainer``'s fault hook: ``rollout``,
``update``, ``sync``, ``logged`` (the step's metrics row written), ``checkpoint`` (its
files written, not yet renamed into place), ``saved``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from tailcut.errors import TailcutError

if TYPE_CHECKING:
    from rich.console import Console

    from tailcut.train.config import TrainConfig
    from tailcut.train.distributed import Ranks
    from tailcut.train.trainer import FaultHook, TrainSummary

T = TypeVar("T")
FAULT_ENV = "TAILCUT_FAULT"


class Interrupted(TailcutError):
    """The run was stopped by a signal (exit 128 + its number)."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(
            f"interrupted by {name}; run the same command again to continue from the last "
            "checkpoint (trainer.resume=auto)"
        )
        self.exit_code = 128 + signum


def train(
    config: Annotated[Path | None, typer.Argument(help="YAML config (see configs/).")] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="Dotted key=value overrides, e.g. cutoff.policy=deadline."),
    ] = None,
) -> None:
    """Train a policy with GRPO on over-sampled, cut-off multi-turn rollouts."""
    from rich.console import Console

    from tailcut.train.config import load_train_config
    from tailcut.train.run_dir import check_run_dir

    console = Console()
    items = list(overrides or [])
    if config is not None and "=" in config.name and not config.exists():
        items.insert(0, str(config))  # `tailcut train key=value` without a file
        config = None
    cfg = load_train_config(config, items)
    n = cfg.trainer.nproc_per_node
    if (n > 1 or cfg.actor.offload) and "RANK" not in os.environ:  # ranks; each comes back here
        raise typer.Exit(launch_ranks(n, ["train", *([str(config)] if config else []), *items]))
    from tailcut.train.distributed import close, from_env

    ranks = from_env(cfg.trainer.dist_timeout_s)
    try:
        if ranks.is_main:
            check_run_dir(cfg)  # before the model is built or loaded (the trainer checks again)
        else:
            console = Console(quiet=True)
        fault = fault_from_env()
        summary = run_until_signal(lambda: _run(cfg, console, fault, ranks))
        ranks.barrier()  # the ranks tear the group down together (one gone first: gloo aborts)
    finally:
        close(ranks)
    _print_summary(console, summary)


def launch_ranks(n: int, args: list[str]) -> int:
    """Run ``tailcut ARGS`` as ``n`` ranks on this machine under torchrun; its exit code."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1"]
    return subprocess.call([*cmd, f"--nproc-per-node={n}", "-m", "tailcut", *args])


def run_until_signal(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``asyncio.run`` at this edge. SIGINT (``asyncio.run`` cancels the main task) and
    SIGTERM (cancelled the same way) come out as :class:`Interrupted`."""
    import asyncio

    stopped: list[int] = []

    async def main() -> T:
        task = asyncio.current_task()
        assert task is not None

        def stop() -> None:
            stopped.append(signal.SIGTERM)
            task.cancel()

        # Not in the main thread (or no signals there): SIGTERM keeps its default.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)
        return await make()

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        raise Interrupted(signal.SIGINT) from None
    except asyncio.CancelledError:
        if stopped:
            raise Interrupted(stopped[0]) from None
        raise


def fault_from_env() -> FaultHook | None:
    """The ``TAILCUT_FAULT`` hook (module docstring), or None."""
    from tailcut.config import ConfigError

    spec = os.environ.get(FAULT_ENV, "")
    only = os.environ.get(FAULT_ENV + "_RANK")  # a job of several ranks: this rank only
    if not spec or (only is not None and only != os.environ.get("RANK", "0")):
        return None
    try:
        step, phase, name = spec.split(":")
        at, signum = (int(step), phase), signal.Signals["SIG" + name.upper().removeprefix("SIG")]
    except (ValueError, KeyError):
        raise ConfigError(
            f"{FAULT_ENV}={spec!r}: give STEP:PHASE:SIGNAL, e.g. 3:logged:KILL"
        ) from None

    def fault(step: int, phase: str) -> None:
        if (step, phase) == at:
            os.kill(os.getpid(), signum)

    return fault


async def _run(
    cfg: TrainConfig, console: Console, fault: FaultHook | None, ranks: Ranks | None = None
) -> TrainSummary:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tailcut.app.train_setup import build_setup
    from tailcut.train.plots import plot_run
    from tailcut.train.trainer import Trainer

    console.print(f"[bold]tailcut train[/bold] → {cfg.trainer.run_dir}")
    setup = build_setup(cfg, ranks)
    trainer = Trainer(cfg, setup, console=console, fault=fault)
    columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("steps", total=cfg.trainer.steps)
            summary = await trainer.run(lambda k, n: bar.update(task, completed=k))
    finally:
        if setup.close is not None:
            await setup.close()
    if ranks is None or ranks.is_main:
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
