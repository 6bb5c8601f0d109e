"""Plots of a run from its ``metrics.jsonl``: validation reward and the training-reward
estimators against step and wall time (``RUN_DIR/plots/*.png``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    with Path(path).open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rows.append(json.loads(line))
    return rows


def series(
    rows: list[dict[str, Any]], key: str, x: str = "step"
) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        if r.get(key) is not None and r.get(x) is not None:
            xs.append(float(r[x]))
            ys.append(float(r[key]))
    return xs, ys


def with_wall_time(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds ``wall_s``: cumulative step time (rollout, update, sync) at the end of each row's
    step; validation, identical in every configuration, is left out."""
    total = 0.0
    out = []
    for r in rows:
        total += float(r.get("timing/step_s") or 0.0)
        out.append({**r, "wall_s": total})
    return out


def plot_run(run_dir: Path) -> list[Path]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    try:
        import matplotlib
    except ImportError:  # plots are optional: the metrics are in metrics.jsonl
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = with_wall_time(read_metrics(path))
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for key in (
        "val/reward",
        "reward/completed_mean",
        "reward/all_zero_filled",
        "reward/group_imputed",
    ):
        xs, ys = series(rows, key)
        if xs:
            axes[0].plot(xs, ys, marker="o" if key == "val/reward" else None, label=key)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("reward")
    axes[0].legend(fontsize=7)
    xs, ys = series(rows, "val/reward", "wall_s")
    axes[1].plot(xs, ys, marker="o")
    axes[1].set_xlabel("training wall time (s, validation excluded)")
    axes[1].set_ylabel("val reward")
    fig.tight_layout()
    target = out_dir / "reward.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return [target]
