"""Metric sinks: JSONL (always), console, TensorBoard and W&B (optional,
:mod:`tailcut.train.wandb_sink`).

Every sink takes ``log(step, metrics)`` with flat ``{"area/name": float}`` dicts and
``close()``. A sink whose package is missing is skipped with one warning line; a run never
fails because a dashboard is not installed (W&B that is installed but cannot start a run
stops the run before its first step, saying why).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Protocol

from rich.console import Console

from tailcut.train.run_dir import atomic_write_text


class MetricSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """``RUN_DIR/metrics.jsonl``: one object a line, ``{"step": k, ...metrics}``; non-finite
    numbers are written as null (valid JSON). Each line is flushed to the OS as it is
    written (a killed process loses none); :meth:`sync` makes them durable (the trainer
    syncs before each checkpoint, so no checkpoint outlives the metrics of its steps). A
    failed write raises ``OSError`` naming the file."""

    def __init__(self, path: Path, *, append: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh: IO[str] = path.open("a" if append else "w", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        row: dict[str, Any] = {"step": step}
        for k, v in metrics.items():
            row[k] = v if isinstance(v, int | float) and math.isfinite(v) else None
        with self._named():
            self._fh.write(json.dumps(row, separators=(",", ":")) + "\n")
            self._fh.flush()

    def sync(self) -> None:
        with self._named():
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        with self._named():
            self._fh.close()

    @contextmanager
    def _named(self) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc


def truncate_jsonl(path: Path, after_step: int) -> None:
    """Drop rows of steps > ``after_step`` (a resumed run rewrites them) and unreadable
    lines (one cut by a crash mid-write); the file is replaced atomically."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            if int(json.loads(line)["step"]) <= after_step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    atomic_write_text(path, "".join(line + "\n" for line in keep))


CONSOLE_KEYS: tuple[tuple[str, str, str], ...] = (
    ("reward/completed_mean", "reward", "{:.3f}"),
    ("val/reward", "val", "{:.3f}"),
    ("rollout/aborted_ratio", "aborted", "{:.0%}"),
    ("rollout/step_time_s", "rollout", "{:.1f}s"),
    ("train/loss", "loss", "{:+.4f}"),
    ("train/entropy", "ent", "{:.3f}"),
    ("timing/step_s", "step", "{:.1f}s"),
)


class ConsoleSink:
    """One summary line per step."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        parts = [f"[bold]step {step}[/bold]"]
        for key, label, fmt in CONSOLE_KEYS:
            value = metrics.get(key)
            if value is not None and math.isfinite(value):
                parts.append(f"{label} {fmt.format(value)}")
        if len(parts) > 1:
            self.console.print("  ".join(parts))

    def close(self) -> None:
        return None


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for k, v in metrics.items():
            if isinstance(v, int | float) and math.isfinite(v):
                self._writer.add_scalar(k, v, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Loggers:
    """Fan-out to every configured sink."""

    def __init__(self, sinks: Sequence[MetricSink]) -> None:
        self.sinks = list(sinks)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def sync(self) -> None:
        """Make what was logged durable (the sinks that write local files)."""
        for sink in self.sinks:
            if isinstance(sink, JsonlSink):
                sink.sync()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def make_loggers(
    names: Sequence[str],
    run_dir: Path,
    *,
    console: Console,
    config: Mapping[str, Any],
    wandb_project: str = "tailcut",
    append: bool = False,
) -> Loggers:
    sinks: list[MetricSink] = [JsonlSink(run_dir / "metrics.jsonl", append=append)]
    for name in names:
        try:
            if name == "console":
                sinks.append(ConsoleSink(console))
            elif name == "tensorboard":
                sinks.append(TensorBoardSink(run_dir / "tensorboard"))
            elif name == "wandb":
                from tailcut.train.wandb_sink import WandbSink

                sinks.append(WandbSink(wandb_project, run_dir, config))
        except ImportError as exc:
            console.print(f"[yellow]logger {name!r} skipped: {exc}[/yellow]")
        except BaseException:  # a sink that cannot start stops the run: close the others
            Loggers(sinks).close()
            raise
    return Loggers(sinks)
