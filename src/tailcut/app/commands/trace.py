"""``tailcut trace perfetto`` and ``tailcut report``: look at a traced run (tailcut's traces,
earlier tailcut traces and the reference profiler's).

Heavy imports (rich, matplotlib) stay inside the commands. Errors are one line on stderr
(exit 1); parts of a trace skipped as cut short by a crash are warnings on stderr.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import typer

trace_app = typer.Typer(name="trace", help="Export rollout traces.", no_args_is_help=True)

TRACE_HELP = (
    "A run directory (its traces/), a traces or benchmark directory (step_*/worker_*.jsonl, "
    "<name>/step_*/...), one step directory or one .jsonl file."
)


def _print_err(label: str, message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"{label} {escape(message)}", highlight=False)


def _fail(message: str) -> typer.Exit:
    _print_err("[red]error:[/red]", message)
    return typer.Exit(1)


def _warn(message: str) -> None:
    _print_err("[yellow]warning:[/yellow]", message)


def _cannot_write(path: Path, exc: OSError) -> typer.Exit:
    return _fail(f"{path}: cannot write ({exc.strerror or exc})")


def _trace_files(run_dir: Path) -> list[Path]:
    """The trace files a command reads from ``run_dir`` (none where it cannot list them:
    reading them then gives the error)."""
    from tailcut.trace.load import TraceError, discover

    try:
        return [path for source in discover(run_dir) for _, path in source.files]
    except (TraceError, OSError):
        return []


def _check_not_input(out: Path, inputs: Iterable[Path]) -> None:
    """Refuse to write ``out`` over one of the trace files read: the same path, however
    written (relative, through a symbolic link) or a hard link to it."""
    if not os.path.lexists(out):
        return
    for src in inputs:
        try:
            same = os.path.samefile(out, src)
        except OSError:  # a dangling link: written over, it changes no input
            continue
        if same:
            raise _fail(f"{out}: the output is the input {src}; choose another output path")


@trace_app.command("perfetto")
def perfetto(
    run_dir: Annotated[Path, typer.Argument(help=TRACE_HELP)],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Output JSON (open in ui.perfetto.dev).")
    ],
    align: Annotated[
        str, typer.Option(help="Time origin: 'step' (each step at 0) or 'run' (one timeline).")
    ] = "step",
) -> None:
    """Write a Chrome/Perfetto trace: one track per request, turns and calls as slices, the cut as an instant."""
    from rich.console import Console

    from tailcut.trace.load import TraceError
    from tailcut.trace.perfetto import write_perfetto

    if align not in ("step", "run"):
        raise _fail(f"--align must be 'step' or 'run', got {align!r}")
    if out.is_dir():
        raise _fail(f"{out}: is a directory (give the output file's path)")
    if not out.parent.is_dir():
        raise _fail(f"{out}: cannot write (no directory {out.parent})")
    _check_not_input(out, _trace_files(run_dir))
    try:
        counts = write_perfetto(run_dir, out, "step" if align == "step" else "run", _warn)
    except TraceError as exc:
        raise _fail(str(exc)) from None
    except OSError as exc:
        raise _cannot_write(out, exc) from None
    Console(soft_wrap=True).print(
        f"wrote {out}: {counts['steps']} step(s), {counts['processes']} worker track group(s), "
        f"{counts['requests']:,} requests, {counts['slices']:,} slices, {counts['cuts']} cut(s)",
        highlight=False,
    )


def report(
    run_dir: Annotated[Path, typer.Argument(help=TRACE_HELP)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
    plot: Annotated[
        Path | None,
        typer.Option(help="Completion-CDF PNG (default: completion_cdf.png in RUN_DIR)."),
    ] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Do not write the plots.")] = False,
) -> None:
    """Tail analysis per step and over the run: completion percentiles, share done by 40/50% of the step, turn mix, wasted tokens, abort-to-idle, tail share; plots of the completion CDF and (several steps) of step and cut time over steps."""
    from tailcut.trace.load import TraceError
    from tailcut.trace.report import analyse_run, plot_cdf, render_tables
    from tailcut.trace.run_report import plot_step_times, render_summary, summarise

    try:
        reports = analyse_run(run_dir, _warn)
    except TraceError as exc:
        raise _fail(str(exc)) from None
    summaries = summarise(reports)
    plot_path = steps_path = None
    if not no_plot:
        plot_path = plot or (run_dir if run_dir.is_dir() else run_dir.parent) / "completion_cdf.png"
        if len(reports) > len(summaries):  # some run has several steps
            steps_path = plot_path.with_name("step_times.png")
        inputs = _trace_files(run_dir)
        for path in (plot_path, steps_path):
            if path is not None:
                _check_not_input(path, inputs)
        for path, draw in ((plot_path, plot_cdf), (steps_path, plot_step_times)):
            if path is None:
                continue
            try:
                draw(reports, path)
            except OSError as exc:
                raise _cannot_write(path, exc) from None
    if as_json:
        payload = {
            "run_dir": str(run_dir),
            "plot": None if plot_path is None else str(plot_path),
            "step_plot": None if steps_path is None else str(steps_path),
            "runs": [s.to_json() for s in summaries],
            "steps": [r.to_json() for r in reports],
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    from rich.console import Console

    console = Console(soft_wrap=True)
    for table in render_tables(reports):
        console.print(table)
    console.print(render_summary(summaries))
    if plot_path is not None:
        console.print(f"completion CDF: {plot_path}", highlight=False)
    if steps_path is not None:
        console.print(f"step and cut time over steps: {steps_path}", highlight=False)
