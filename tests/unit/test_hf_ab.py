"""A switch against the defaults, alternated (``python -m tailcut.bench.hf_ab``): the
summary's arithmetic, the bad input it refuses, and two real sweeps on CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import tailcut
from tailcut.bench.hf_ab import main, run_ab, summarize

pytestmark = pytest.mark.timeout(300)


def _run(ms: dict[int, float], bound: float = 0.3) -> dict:
    return {"batches": [{"batch": b, "decode_ms_per_pass": x, "bound_ms_per_pass": bound}
                        for b, x in ms.items()]}  # fmt: skip


def test_the_ratio_is_of_the_medians_beside_each_sides_spread() -> None:
    a = [_run({64: 1.20, 256: 1.50}), _run({64: 1.10, 256: 1.52}), _run({64: 1.16, 256: 1.49})]
    b = [_run({64: 1.00, 256: 1.60}), _run({64: 1.05, 256: 1.58}), _run({64: 1.02, 256: 1.61})]
    rows = {r["batch"]: r for r in summarize(a, b)}
    assert rows[64]["a_ms"] == [1.20, 1.10, 1.16] and rows[64]["b_ms"] == [1.00, 1.05, 1.02]
    assert rows[64]["a_over_b"] == pytest.approx(1.16 / 1.02)
    assert rows[64]["a_spread"] == pytest.approx((1.20 - 1.10) / 1.16)
    assert rows[64]["b_spread"] == pytest.approx((1.05 - 1.00) / 1.02)
    assert rows[64]["a_of_bound"] == pytest.approx(0.3 / 1.16)
    assert rows[256]["a_over_b"] == pytest.approx(1.50 / 1.60)  # B slower: below 1


def test_a_run_missing_a_batch_size_or_without_decode_passes_is_named() -> None:
    with pytest.raises(ValueError, match="run B2 has no batch 256"):
        summarize([_run({64: 1.0, 256: 1.5})], [_run({64: 1.0, 256: 1.5}), _run({64: 1.0})])
    with pytest.raises(ValueError, match="run A1 timed no decode pass at batch 64"):
        summarize([_run({64: 0.0})], [_run({64: 1.0})])


def test_an_unknown_switch_or_no_round_is_refused_before_any_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--switch turbo: name one or more of .*pdl"):
        run_ab("random-tiny", ["turbo"], tmp_path, batches=[2])
    with pytest.raises(ValueError, match=r"--switch \(none\): .*or an --inductor setting"):
        run_ab("random-tiny", [], tmp_path, batches=[2])
    with pytest.raises(ValueError, match="--rounds 1: at least 2"):
        run_ab("random-tiny", ["pdl"], tmp_path, batches=[2], rounds=1)
    with pytest.raises(ValueError, match=r"torch\._inductor\.config has no 'turbo'"):
        run_ab("random-tiny", [], tmp_path, batches=[2], inductor=["turbo=1"])
    with pytest.raises(ValueError, match=r"--a-src .*: no tailcut package there"):
        run_ab("random-tiny", [], tmp_path, batches=[2], a_src=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_run_is_named_with_its_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"run A1 exited \d+:.*hf_sweep") as info:
        run_ab(str(tmp_path / "no-model"), ["no-fuse"], tmp_path / "out", batches=[2],
               device="cpu")  # fmt: skip
    assert "no-model" in str(info.value)


@pytest.mark.slow
def test_real_sweeps_alternate_and_the_summary_reads_their_files(tmp_path: Path) -> None:
    """Four sweeps, A B then B A; the summary's figures are those of the runs' own files."""
    out = tmp_path / "ab"
    main([
        "random-tiny", "--switch", "no-fuse", "no-overlap", "--rounds", "2", "--batch", "2",
        "--max-new-tokens", "4", "--device", "cpu", "--dtype", "float32", "--out", str(out),
    ])  # fmt: skip
    figures = json.loads((out / "ab.json").read_text())
    assert figures["order"] == ["A1", "B1", "B2", "A2"] and figures["rounds"] == 2
    a, b = ([json.loads((out / f"{s}{i}.json").read_text()) for i in (1, 2)] for s in "ab")
    assert all(run["engine_options"] == {} for run in a)
    assert all(run["engine_options"] == figures["b_engine_options"] for run in b)
    assert figures["b_engine_options"] == {"fuse_projections": False, "overlap": False}
    (row,) = figures["batches"]
    a_ms = [run["batches"][0]["decode_ms_per_pass"] for run in a]
    b_ms = [run["batches"][0]["decode_ms_per_pass"] for run in b]
    assert row["batch"] == 2 and row["a_ms"] == a_ms and row["b_ms"] == b_ms
    assert row["a_over_b"] == pytest.approx((sum(a_ms) / 2) / (sum(b_ms) / 2))
    assert all(run["batches"][0]["tokens"] == 8 for run in a + b)


@pytest.mark.slow
def test_a_runs_another_source_tree_with_a_src(tmp_path: Path) -> None:
    """``--a-src``: A's sweeps import tailcut from the tree given (here a copy of this
    one), B's from this one; a tree whose runs would import another copy is refused."""
    here = Path(tailcut.__file__).resolve().parent
    before = tmp_path / "before" / "src"
    shutil.copytree(here, before / "tailcut", ignore=shutil.ignore_patterns("__pycache__"))
    figures = run_ab(
        "random-tiny", [], tmp_path / "ab", batches=[2], max_new_tokens=4, device="cpu",
        dtype="float32", a_src=before,
    )  # fmt: skip
    assert figures["a_source"] == str(before.resolve() / "tailcut")
    assert figures["b_source"] == str(here)
    assert figures["order"] == ["A1", "B1", "B2", "A2"] and len(figures["batches"]) == 1
    shadowed = tmp_path / "shadowed"
    (shadowed / "tailcut").mkdir(parents=True)
    (shadowed / "tailcut" / "__init__.py").write_text("raise ImportError('broken copy')\n")
    with pytest.raises(ValueError, match=r"--a-src .*shadowed: a run there imports tailcut"):
        run_ab("random-tiny", [], tmp_path / "ab2", batches=[2], a_src=shadowed)
