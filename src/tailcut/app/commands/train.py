"""``tailcut train CONFIG.yaml [key=value ...]``: the GRPO training job.

Errors come out through the CLI's boundary (``app/cli.py``): a bad config or run directory
exits 2 before the model is loaded. SIGINT and SIGTERM cancel the run (its ``finally``
blocks close the metrics file, workers and engine) and exit 130 / 143 with one line; the
same command continues from the last checkpoint. During setup (checking the run directory,
building or loading the model, data and engine: blocking work the event loop cannot
interrupt) either signal raises at once where the work is, so the run stops within
moments, not when the work ends (a model build removes its temporary directory: nothing
half-built is left for a later run to load). While the ranks of a sharded run join the
process group or tear it down, SIGTERM keeps its default action.

``TAILCUT_FAULT=STEP:PHASE:SIGNAL`` (crash tests only; ``TAILCUT_FAULT_RANK=R``: in rank R
of a job only) makes the run send itself SIGNAL (INT, TERM or KILL) at PHASE of STEP, a phase of ``Trainer``'s fault hook: ``rollout``,
``update``, ``sync``, ``logged`` (the step's metrics row written), ``checkpoint`` (its
files written, not yet renamed into place), ``saved``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tailcut.app.signals import Stop, last_signal, run_until_signal, stop_at_once
from tailcut.errors import TailcutError

if TYPE_CHECKING:
    from rich.console import Console

    from tailcut.train.config import TrainConfig
    from tailcut.train.distributed import Ranks
    from tailcut.train.trainer import FaultHook, TrainSummary

FAULT_ENV = "TAILCUT_FAULT"


class Interrupted(TailcutError):
    """The run was stopped by a signal (exit 128 + its number)."""

    def __init__(self, signum: int, *, in_setup: bool = False) -> None:
        name = signal.Signals(signum).name
        if in_setup:
            text = (
                f"interrupted by {name} during setup (config, model, data, engine), before "
                "any step; run the same command again to start (or continue from the last "
                "checkpoint: trainer.resume=auto)"
            )
        else:
            text = (
                f"interrupted by {name}; run the same command again to continue from the last "
                "checkpoint (trainer.resume=auto)"
            )
        super().__init__(text)
        self.exit_code = 128 + signum


def _interrupted(signum: int, in_setup: bool) -> Interrupted:
    return Interrupted(signum, in_setup=in_setup)


def train(
    config: Annotated[
        Path | None,
        typer.Argument(help="YAML config (see configs/); left out, every setting is its default."),
    ] = None,
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
    key, eq, _ = str(config).partition("=")
    if config is not None and eq and "/" not in key and not config.exists():
        items.insert(0, str(config))  # `tailcut train key=value` without a file (the value
        config = None  # may be a path: engine.model=/models/x)
    cfg = load_train_config(config, items)
    n = cfg.trainer.nproc_per_node
    if (n > 1 or cfg.actor.offload) and "RANK" not in os.environ:  # ranks; each comes back here
        raise typer.Exit(launch_ranks(n, ["train", *([str(config)] if config else []), *items]))
    if config is None and "RANK" not in os.environ:
        console.print(
            "note: no config file given; every setting but the overrides is its default",
            soft_wrap=True,
        )
    from tailcut.train.distributed import close, from_env

    # While the ranks join and tear down, SIGTERM keeps its default action: those calls
    # block in C++, where a Python handler would run only after the group's time-out.
    ranks = from_env(cfg.trainer.dist_timeout_s)
    stopped: list[int] = []
    summary: TrainSummary | None = None
    try:
        # checking the run directory, then the run: SIGTERM stops it as SIGINT does
        with stop_at_once(stopped, signal.SIGTERM):
            try:
                if ranks.is_main:  # before the model is built or loaded (the trainer checks
                    check_run_dir(cfg)  # again)
                    can_create_run_dir(cfg.trainer.run_dir)
                else:
                    console = Console(quiet=True)
                fault = fault_from_env()
                summary = run_until_signal(
                    lambda ready: _run(cfg, console, fault, ranks, ready), _interrupted, stopped
                )
            except (KeyboardInterrupt, Stop):
                raise Interrupted(last_signal(stopped), in_setup=summary is None) from None
        ranks.barrier()  # the ranks tear the group down together (one gone first: gloo aborts)
    finally:
        close(ranks)
    _print_summary(console, summary)


def can_create_run_dir(run_dir: str) -> None:
    """Create ``trainer.run_dir`` where it is missing, and remove again what was created
    (the trainer claims it once the model is loaded): a directory that cannot be made (a
    parent that is a file or read-only, a path under /proc) is a ``RunDirError`` naming the
    field before the model is built or loaded."""
    from tailcut.train.run_dir import RunDirError

    where = f"trainer.run_dir={run_dir}"
    path = Path(run_dir)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    above = next((p for p in path.parents if p.exists()), None)
    if missing and above is not None and not above.is_dir():
        raise RunDirError(f"{where}: {above} is a file; give a directory for the run")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = (exc.strerror or type(exc).__name__).lower()
        raise RunDirError(
            f"{where}: cannot create {exc.filename or path} ({why}); give a directory that "
            "can be created, e.g. trainer.run_dir=runs/NAME"
        ) from None
    finally:
        for created in missing:  # deepest first; one that is not empty stays
            with contextlib.suppress(OSError):
                created.rmdir()


def launch_ranks(n: int, args: list[str]) -> int:
    """Run ``tailcut ARGS`` as ``n`` ranks on this machine under torchrun; its exit code."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1"]
    return subprocess.call([*cmd, f"--nproc-per-node={n}", "-m", "tailcut", *args])


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
    cfg: TrainConfig,
    console: Console,
    fault: FaultHook | None,
    ranks: Ranks | None = None,
    ready: Callable[[], None] | None = None,
) -> TrainSummary:
    """The run: its setup (``ready()`` once it is done: :func:`run_until_signal`), then the
    trainer's steps; the setup is closed whatever happens after it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tailcut.app.train_setup import build_setup
    from tailcut.train.plots import plot_run
    from tailcut.train.trainer import Trainer

    console.print(f"[bold]tailcut train[/bold] → {cfg.trainer.run_dir}")
    setup = build_setup(cfg, ranks)
    try:
        if ready is not None:
            ready()
        trainer = Trainer(cfg, setup, console=console, fault=fault)
        columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
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
