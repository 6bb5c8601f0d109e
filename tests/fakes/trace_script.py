"""Write synthetic step traces through the real ``Tracer``, from a few lines of description.

Times are seconds since the step start (the tracer's clock reads 0 when it is made). Each
request is launched at ``start``; its turns are (turn start, engine call end, tool call end or
None); it ends at ``end`` with ``status`` (completed, truncated, aborted, failed), emitting
the same records and duration semantics as the scheduler: complete/failed measure from the
launch, aborted and the cut from the step start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailcut.trace.events import EventKind, Tracer


@dataclass
class Req:
    end: float
    status: str = "completed"
    turns: list[tuple[float, float, float | None]] = field(default_factory=list)
    tokens: int = 10
    start: float = 0.0
    tools: int = 1
    """Tool calls per turn, concurrent: each starts 0.5 ms and ends 1 ms after the previous."""


_Record = tuple[float, EventKind, str | None, float, dict[str, Any]]


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _request_events(i: int, r: Req) -> list[_Record]:
    wid = f"req-{i:06d}"
    out: list[_Record] = [(r.start, EventKind.REQUEST_START, wid, 0.0, {"index": i, "group": i})]
    for k, (t0, gen_end, tool_end) in enumerate(r.turns):
        out.append((t0, EventKind.TURN_START, wid, 0.0, {"turn": k}))
        if gen_end <= r.end:
            extra = {
                "turn": k,
                "engine_request_id": f"rq-{i:021d}",
                "prompt_tokens": 20 + 30 * k,
                "output_tokens": 5,
                "finish_reason": "stop",
            }
            out.append((gen_end, EventKind.TURN_ENGINE_CALL, wid, gen_end - t0, extra))
        last = gen_end
        if tool_end is not None and tool_end <= r.end:
            for j in range(r.tools):
                # concurrent calls that overlap without nesting: later start, later end
                end = tool_end - 0.001 * (r.tools - 1 - j)
                extra = {"turn": k, "name": f"tool{j}", "status": "ok"}
                out.append((end, EventKind.TOOL_CALL, wid, end - gen_end - 0.0005 * j, extra))
            last = tool_end
        if last <= r.end and not (r.status == "aborted" and k == len(r.turns) - 1):
            out.append((last, EventKind.TURN_END, wid, last - t0, {"turn": k}))
    n_turns = len(r.turns)
    if r.status == "aborted":
        extra = {"engine_request_id": f"rq-{i:021d}", "output_tokens": r.tokens, "turns": n_turns}
        out.append((r.end, EventKind.REQUEST_ABORTED, wid, r.end, extra))
    elif r.status == "failed":
        extra = {"error": "RuntimeError: boom", "output_tokens": r.tokens}
        out.append((r.end, EventKind.REQUEST_FAILED, wid, r.end - r.start, extra))
    else:
        extra = {"status": r.status, "turns": n_turns, "output_tokens": r.tokens}
        out.append((r.end, EventKind.REQUEST_COMPLETE, wid, r.end - r.start, extra))
    return out


def write_step(
    run_dir: Path,
    step: int,
    reqs: list[Req],
    *,
    step_end: float,
    cut: float | None = None,
    worker: int = 0,
    global_target: tuple[int, int] | None = None,
) -> Path:
    """Write ``run_dir/step_{step}/worker_{worker}.jsonl``; return its path.
    ``global_target``: (target, launched) of the coordinator of a step cut over all
    workers, recorded on the monitoring event."""
    clock = _Clock()
    tracer = Tracer.for_step(run_dir, step, worker, clock)
    events = [e for i, r in enumerate(reqs) for e in _request_events(i, r)]
    n = len(reqs)
    if cut is not None:
        done = sum(r.end <= cut and r.status != "aborted" for r in reqs)
        events.append(
            (
                cut,
                EventKind.CUTOFF,
                None,
                cut,
                {"reason": "target", "done": done, "launched": n},
            )
        )
    mon: dict[str, Any] = {"total_requests": n, "target_completion": n, "completed_count": 0}
    if global_target is not None:
        mon["global_target"], mon["global_launched"] = global_target
    events.append(
        (
            step_end,
            EventKind.STEP_MONITORING,
            None,
            cut if cut is not None else step_end,
            mon,
        )
    )
    events.append((step_end, EventKind.STEP_TOTAL, None, step_end, {}))
    for t, kind, wid, dur, extra in sorted(events, key=lambda e: e[0]):
        clock.t = t
        tracer.emit(kind, wid, duration_sec=dur, **extra)
    tracer.close()
    assert tracer.path is not None
    return tracer.path
