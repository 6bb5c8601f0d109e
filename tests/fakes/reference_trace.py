"""Trace files as other writers leave them, written line by line (no tailcut ``Tracer``).

* :func:`write_reference_step` — the reference profiler: ``workid`` the rank (an int), a
  uuid-like ``extra.request_id``, no ``request_start``, no token counts; a completion measures
  from the request's launch, an abort from the step start and is followed by its
  ``_padding`` event; ``async_rollout_with_monitoring_duration`` spans the rollout up to the
  cut, ``total_step_duration`` the step; a ``generate_sequences`` event tailcut does not read.
* :func:`write_legacy_step` — tailcut before the schema marker: ``workid`` a request label
  (``"step"`` for step-level events), the engine call id in ``extra.request_id``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

T0 = 1_760_000_000.0
"""Wall time of every fake step's start."""


def _line(
    t: float, event: str, duration: float, extra: dict[str, Any], workid: Any, step: int
) -> str:
    stamp = datetime.fromtimestamp(T0 + t, UTC).isoformat()
    return json.dumps(
        {
            "timestamp": stamp,
            "event": event,
            "duration_sec": duration,
            "extra": extra,
            "workid": workid,
            "step": step,
        }
    )


def reference_id(worker: int, i: int) -> str:
    return f"45bb6a77-{worker:04d}-4e1c-9a0b-{i:012d}"


def write_reference_step(
    root: Path,
    step: int,
    worker: int,
    ends: list[float],
    *,
    cut: float | None,
    launches: list[float] | None = None,
    total: bool = True,
) -> Path:
    """Requests launched at ``launches`` (default 0) end at ``ends``; those ending after
    ``cut`` are aborted at ``cut``. Returns the file's path."""
    launches = launches or [0.0] * len(ends)
    rows: list[tuple[float, str]] = []
    done = 0
    for i, (start, end) in enumerate(zip(launches, ends, strict=True)):
        rid = reference_id(worker, i)
        if cut is not None and end > cut:
            rows.append((cut, _line(cut, "aborted_request_with_cancelled_error", cut,
                                    {"request_id": rid}, worker, step)))  # fmt: skip
            rows.append((cut + 0.0025, _line(cut + 0.0025,
                                             "aborted_request_with_cancelled_error_padding",
                                             0.0025, {"request_id": rid}, worker, step)))  # fmt: skip
        else:
            done += 1
            rows.append((end, _line(end, "async_rollout_request_complete", end - start,
                                    {"request_id": rid}, worker, step)))  # fmt: skip
    stop = cut if cut is not None else max(ends)
    mon = {"total_requests": len(ends), "target_completion": done, "completed_count": done}
    rows.append(
        (stop, _line(stop, "async_rollout_with_monitoring_duration", stop, mon, worker, step))
    )
    rows.append((stop + 0.5, _line(stop + 0.5, "generate_sequences", stop + 0.5, {}, worker, step)))
    if total:
        rows.append(
            (stop + 1.0, _line(stop + 1.0, "total_step_duration", stop + 1.0, {}, worker, step))
        )
    path = root / f"step_{step}" / f"worker_{worker}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for _, line in sorted(rows, key=lambda r: r[0])))
    return path


def write_legacy_step(root: Path, step: int, ends: list[float], *, cut: float | None) -> Path:
    """One worker's version-1 trace: one-turn requests launched at 0 with 10 tokens each."""
    rows: list[tuple[float, str]] = []
    for i, end in enumerate(ends):
        wid = f"req-{i:06d}"
        rows.append((0.0, _line(0.0, "request_start", 0.0, {"index": i, "group": 0}, wid, step)))
        if cut is not None and end > cut:
            extra = {"request_id": f"rq-{i:05d}", "output_tokens": 4, "turns": 1}
            rows.append(
                (cut, _line(cut, "aborted_request_with_cancelled_error", cut, extra, wid, step))
            )
            continue
        call = {
            "turn": 0,
            "request_id": f"rq-{i:05d}",
            "output_tokens": 10,
            "finish_reason": "stop",
        }
        rows.append((end, _line(end, "turn_engine_call", end, call, wid, step)))
        extra = {"status": "completed", "turns": 1, "output_tokens": 10}
        rows.append((end, _line(end, "async_rollout_request_complete", end, extra, wid, step)))
    stop = cut if cut is not None else max(ends)
    if cut is not None:
        extra = {"reason": "target", "done": sum(e <= cut for e in ends), "launched": len(ends)}
        rows.append((cut, _line(cut, "cutoff_decision", cut, extra, "step", step)))
    rows.append((stop, _line(stop, "total_step_duration", stop, {}, "step", step)))
    path = root / f"step_{step}" / "worker_0.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for _, line in sorted(rows, key=lambda r: r[0])))
    return path
