"""Benchmark: engine switches against the defaults, alternated on one machine.

A switch that moves a decode pass by a few percent is lost in the spread between hosts,
and between sessions on one host (0.5B at batch 64 on H100s: 1.118–1.198 ms a pass with
the same code). ``python -m tailcut.bench.hf_ab MODEL --switch pdl`` runs the batch sweep
(:mod:`tailcut.bench.hf_sweep`) without the switches (A) and with them (B), alternated
``--rounds`` times (A B, then B A, ...) so that the card's and the host's drift falls on
both, each run in a process of its own (nothing one run sets or compiles in memory carries
to the next; inductor's on-disk cache of compiled kernels does, and warm-up runs are not
timed). B may also set inductor's config (``--inductor KEY=VALUE``, such as
``combo_kernels=true``): what the compiled decode forward is built with, which no engine
switch exposes. With ``--a-src DIR`` A's runs import tailcut from another source tree
(``git worktree add /tmp/before REV``, then ``--a-src /tmp/before/src``): a code change
A/B'd as a switch is, B being the tree that runs ``hf_ab``. It prints each run's decode
milliseconds a pass (the median of the run's five timed windows, ``hf_sweep
--timed-runs``) and, per batch size, the ratio of the medians — A ÷ B, above 1 where B
makes a pass faster — beside the spread of A's own runs: a ratio within that spread is
not a measured gain.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tailcut.bench.hf_sweep import SWITCHES, inductor_settings, spread

SWITCH_NAMES = {flag.removeprefix("--"): flag for flag in SWITCHES}
"""``--switch`` values: :data:`hf_sweep.SWITCHES`' flags without their dashes."""


def _ms(run: dict[str, Any]) -> dict[int, float]:
    return {b["batch"]: b["decode_ms_per_pass"] for b in run["batches"]}


def summarize(a_runs: list[dict[str, Any]], b_runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch size, from the sweeps' figures (``hf_sweep`` JSON) of the A and B runs:
    each run's decode ms a pass, the medians, ``a_over_b`` (median A ÷ median B) and the
    relative spread of each side's runs ((max − min) ÷ median). Raises ``ValueError`` if a
    run lacks a batch size the first A run has, or timed no decode pass at it."""
    if not a_runs or not b_runs:
        raise ValueError("summarize needs at least one A run and one B run")
    rows = []
    for batch, bound_ms in ((b["batch"], b["bound_ms_per_pass"]) for b in a_runs[0]["batches"]):
        sides = {}
        for side, runs in (("a", a_runs), ("b", b_runs)):
            ms = []
            for i, run in enumerate(runs):
                timed = _ms(run).get(batch)
                if timed is None:
                    raise ValueError(f"run {side.upper()}{i + 1} has no batch {batch}")
                if not timed > 0:
                    raise ValueError(
                        f"run {side.upper()}{i + 1} timed no decode pass at batch {batch} "
                        "(a request's first token comes from its prefill: give it more tokens)"
                    )
                ms.append(timed)
            sides[side] = ms
        med = {side: statistics.median(ms) for side, ms in sides.items()}
        rows.append({
            "batch": batch, "a_ms": sides["a"], "b_ms": sides["b"],
            "a_median_ms": med["a"], "b_median_ms": med["b"], "a_over_b": med["a"] / med["b"],
            "a_spread": spread(sides["a"]), "b_spread": spread(sides["b"]),
            "a_of_bound": bound_ms / med["a"], "b_of_bound": bound_ms / med["b"],
        })  # fmt: skip
    return rows


def _sweep(cmd: list[str], label: str, timeout_s: float, src: Path | None = None) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_env(src))
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"run {label} took over {timeout_s:.0f} s: {' '.join(cmd)}") from exc
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"run {label} exited {done.returncode}: {' '.join(cmd)}\n{tail}")


def _env(src: Path | None) -> dict[str, str] | None:
    """The environment of a run that imports tailcut from ``src`` (None: this one's)."""
    if src is None:
        return None
    path = os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path}


def _check_source(src: Path) -> None:
    """That a run given ``src`` imports tailcut from there (not an installed copy)."""
    cmd = [sys.executable, "-c", "import tailcut; print(tailcut.__file__)"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(src), timeout=60)
    got = Path(done.stdout.strip()).resolve() if done.returncode == 0 else None
    if got is None or not got.is_relative_to(src):
        raise ValueError(f"--a-src {src}: a run there imports tailcut from {got}, not from it")


def run_ab(
    model: str, switches: list[str], out_dir: Path, *, batches: list[int], rounds: int = 2,
    max_new_tokens: int = 128, device: str = "auto", dtype: str = "auto",
    hbm_gbs: float | None = None, timeout_s: float = 600.0, inductor: Sequence[str] = (),
    a_src: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A (the defaults) and B (``switches``, names of :data:`SWITCH_NAMES`, and
    ``inductor``, ``KEY=VALUE`` settings of inductor's config) alternated ``rounds`` times
    on ``model`` (a directory or a ``random-*`` name); each run's figures go to
    ``out_dir/a{i}.json`` / ``b{i}.json``, the summary to ``out_dir/ab.json``. Raises
    ``ValueError`` for an unknown switch or setting, or none given, ``RuntimeError``
    naming the run that failed or overran ``timeout_s``. ``a_src``: the source tree (the
    folder holding the ``tailcut`` package) A's runs import tailcut from (checked before
    the first run); the sweeps' figures name the tree they ran (``source``)."""
    unknown = [s for s in switches if s not in SWITCH_NAMES]
    if unknown or not (switches or inductor or a_src):
        raise ValueError(
            f"--switch {' '.join(unknown) or '(none)'}: name one or more of "
            f"{', '.join(SWITCH_NAMES)} (or an --inductor setting, or --a-src)"
        )
    if a_src is not None:
        a_src = a_src.resolve()
        if not (a_src / "tailcut" / "__init__.py").is_file():
            raise ValueError(f"--a-src {a_src}: no tailcut package there (give its src folder)")
        _check_source(a_src)
    inductor_settings(list(inductor))  # refused here, before any run
    if inductor and device == "cpu":
        raise ValueError(
            "--inductor needs the compiled decode forward, which the sweep compiles on CUDA only"
        )
    if rounds < 2:
        raise ValueError(f"--rounds {rounds}: at least 2 (a side's spread needs two runs)")
    out_dir.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "tailcut.bench.hf_sweep", model, "--batch", *map(str, batches),
            "--max-new-tokens", str(max_new_tokens), "--device", device, "--dtype", dtype,
            "--no-release"]  # fmt: skip
    if hbm_gbs is not None:
        base += ["--hbm-gbs", str(hbm_gbs)]
    b_args = [SWITCH_NAMES[s] for s in switches]
    b_args += [arg for pair in inductor for arg in ("--inductor", pair)]
    runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    order: list[str] = []
    figures: dict[str, Any] = {}
    for i in range(1, rounds + 1):
        sides = (("a", []), ("b", b_args)) if i % 2 else (("b", b_args), ("a", []))
        for side, extra in sides:
            path = out_dir / f"{side}{i}.json"
            src = a_src if side == "a" else None
            _sweep([*base, *extra, "--out", str(path)], f"{side.upper()}{i}", timeout_s, src)
            runs[side].append(json.loads(path.read_text(encoding="utf-8")))
            order.append(f"{side.upper()}{i}")
        first = runs["a"][0]
        figures = {  # after each round, so that a run cut short keeps its rounds
            "model": model, "card": first["card"], "device": first["device"],
            "a_src": str(a_src) if a_src is not None else None,
            "dtype": first["dtype"], "switches": switches, "inductor": list(inductor),
            "rounds": i, "max_new_tokens": max_new_tokens, "hbm_gbs": first["hbm_gbs"],
            "order": order, "b_engine_options": runs["b"][0]["engine_options"],
            "a_source": runs["a"][0].get("source"), "b_source": runs["b"][0].get("source"),
            "batches": summarize(runs["a"], runs["b"]),
        }  # fmt: skip
        (out_dir / "ab.json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return figures


def _print(figures: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{figures['model']} on {figures['card'] or figures['device']}: A defaults"
        f"{' of ' + figures['a_src'] if figures.get('a_src') else ''}, B "
        f"{' '.join(figures['switches'] + figures['inductor']) or 'defaults'}; "
        f"{figures['rounds']} rounds, {' '.join(figures['order'])}"
    )
    for col in ("batch", "A ms a pass", "B ms a pass", "A of bound", "B of bound", "A ÷ B",
                "A spread"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in figures["batches"]:
        table.add_row(
            str(r["batch"]), " ".join(f"{x:.3f}" for x in r["a_ms"]),
            " ".join(f"{x:.3f}" for x in r["b_ms"]), f"{r['a_of_bound']:.1%}",
            f"{r['b_of_bound']:.1%}", f"{r['a_over_b']:.3f}", f"{r['a_spread']:.1%}",
        )  # fmt: skip
    Console().print(table)


def main(argv: list[str] | None = None) -> None:
    """``python -m tailcut.bench.hf_ab MODEL --switch pdl [--inductor KEY=VALUE]
    [--a-src DIR] [--rounds 2] [--batch 64]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tailcut.bench.hf_ab")
    ap.add_argument("model", help="model directory or random-* name")
    ap.add_argument("--switch", nargs="+", default=[], choices=sorted(SWITCH_NAMES),
                    help="what B sets away from the defaults (hf_sweep's flags)")  # fmt: skip
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                    help="a torch._inductor.config setting for B (repeatable)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[64])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--hbm-gbs", type=float, help="bandwidth of the bound, GB/s")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="the most one run may take")
    ap.add_argument("--out", type=Path, default=Path("ab"), help="folder for the runs' JSON")
    ap.add_argument("--a-src", type=Path, help="source tree (its src folder) A's runs import")
    a = ap.parse_args(argv)
    try:
        figures = run_ab(
            a.model, a.switch, a.out, batches=a.batch, rounds=a.rounds,
            max_new_tokens=a.max_new_tokens, device=a.device, dtype=a.dtype,
            hbm_gbs=a.hbm_gbs, timeout_s=a.timeout_s, inductor=a.inductor, a_src=a.a_src,
        )  # fmt: skip
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"hf_ab: {exc}") from None
    _print(figures)


if __name__ == "__main__":
    main()
