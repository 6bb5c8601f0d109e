"""The W&B metric sink (``trainer.loggers: [..., wandb]``; the ``wandb`` extra installs it).

One W&B run per run directory: its id is kept in ``RUN_DIR/wandb/tailcut-run-id``, so a
resumed training run goes on logging into the same W&B run. What it gets:

* the resolved config (the run's config, and ``config.yaml`` as a run file);
* every step's metrics (non-finite values left out, as the JSONL writes them null);
* the step's tail: the completion CDF of its rollout requests with the cut marked
  (:func:`tailcut.trace.report.plot_cdf`, from ``RUN_DIR/traces/step_k``), as the image
  ``tail/completion_cdf``; its PNG stays in ``RUN_DIR/plots/tail/``.

The usual ``WANDB_*`` settings apply: ``WANDB_MODE=offline`` logs to local files only (sync
them later with ``wandb sync``), ``WANDB_DIR`` moves those files out of the run directory
(default ``RUN_DIR/wandb``), ``WANDB_ENTITY`` / ``WANDB_NAME`` / ``WANDB_TAGS``, etc. A run
that cannot start (online without credentials) stops training before the first step, with
the reason.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tailcut.errors import TailcutError

_log = logging.getLogger(__name__)
RUN_ID_FILE = "tailcut-run-id"


class WandbError(TailcutError, RuntimeError):
    """W&B could not start a run (the message says why and what to set)."""


def run_id(run_dir: Path) -> str:
    """The W&B run id of ``run_dir`` (made and kept on first use)."""
    path = Path(run_dir) / "wandb" / RUN_ID_FILE
    if path.is_file():
        kept = path.read_text(encoding="utf-8").strip()
        if kept:
            return kept
    path.parent.mkdir(parents=True, exist_ok=True)
    new = secrets.token_hex(4)
    path.write_text(new + "\n", encoding="utf-8")
    return new


def tail_plot(run_dir: Path, step: int) -> Path | None:
    """``RUN_DIR/plots/tail/step_{step}.png``: the step's completion CDF, or None when the
    step left no trace (validation-only step 0, ``trainer.trace=false``)."""
    from tailcut.trace.load import load_run
    from tailcut.trace.report import analyse_step, plot_cdf

    step_dir = Path(run_dir) / "traces" / f"step_{step}"
    if not step_dir.is_dir():
        return None
    steps = load_run(step_dir, warn=_log.warning)
    target = Path(run_dir) / "plots" / "tail" / f"step_{step}.png"
    return plot_cdf([analyse_step(s) for s in steps], target)


class WandbSink:
    """Metrics, the resolved config and each step's tail plot to a W&B run."""

    def __init__(
        self, project: str, run_dir: Path, config: Mapping[str, Any], *, tail_plots: bool = True
    ) -> None:
        import wandb

        self._wandb = wandb
        self.run_dir = Path(run_dir)
        self.tail_plots = tail_plots
        self._plot_failed = False
        try:
            self._run = wandb.init(
                project=project,
                dir=os.environ.get("WANDB_DIR") or str(self.run_dir),
                config=dict(config),
                id=run_id(self.run_dir),
                name=os.environ.get("WANDB_NAME") or self.run_dir.name,
                resume="allow",
            )
        except Exception as exc:  # wandb's own errors (no API key, bad entity) and OSError
            raise WandbError(
                f"logger 'wandb': the W&B run did not start: {type(exc).__name__}: {exc} "
                "(set WANDB_API_KEY, or WANDB_MODE=offline to log to local files only)"
            ) from exc
        config_file = self.run_dir / "config.yaml"
        if config_file.is_file():
            self._run.save(str(config_file), base_path=str(self.run_dir), policy="now")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        row: dict[str, Any] = {
            k: v for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)
        }
        image = self._tail_image(step)
        if image is not None:
            row["tail/completion_cdf"] = image
        self._run.log(row, step=step)

    def _tail_image(self, step: int) -> Any:
        if not self.tail_plots or self._plot_failed:
            return None
        try:
            path = tail_plot(self.run_dir, step)
        except Exception as exc:  # a plot is never worth a run: warn once, log the metrics
            self._plot_failed = True
            _log.warning("wandb: no tail plots from step %d on: %s", step, exc)
            return None
        if path is None:
            return None
        return self._wandb.Image(str(path), caption=f"step {step}: request completion CDF")

    def close(self) -> None:
        self._run.finish()
