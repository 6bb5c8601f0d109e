"""The embedded engine's batch sweep (``python -m tailcut.bench.hf_sweep``) on CPU: the
figures beside the weight-read bound, release/resume, and the profiled run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tailcut.bench.hf_sweep import card_gbs, inductor_settings, main, run_hf_sweep

pytestmark = pytest.mark.timeout(300)


def test_the_sweep_reports_each_batch_and_where_a_pass_goes(tmp_path: Path) -> None:
    """Pass counts are not pinned: the sweep reads the worker's counters as a run's results
    come back, and the worker may count a run's last pass just after (one pass either way;
    at 6 tokens a request that is a sixth)."""
    out = tmp_path / "sweep.json"
    figures = run_hf_sweep(
        "random-tiny", [2, 4], max_new_tokens=6, device="cpu", dtype="float32", threads=1,
        json_out=True, out=out, profile=True, timed_runs=3,
    )  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(figures))
    assert [b["batch"] for b in figures["batches"]] == [2, 4]
    for b in figures["batches"]:
        assert b["tokens"] == b["batch"] * 6  # EOS ignored: every request its budget
        assert b["decode_passes"] > 0 and b["mean_batch"] > 0
        assert b["of_bound"] == pytest.approx(b["bound_ms_per_pass"] / b["decode_ms_per_pass"])
        runs = b["decode_ms_per_pass_runs"]  # the figures are the median of three timed runs
        assert len(runs) == 3 and b["decode_ms_per_pass"] == sorted(runs)[1]
        assert b["decode_spread"] == pytest.approx((max(runs) - min(runs)) / sorted(runs)[1])
        assert b["release"]["greedy_equal_after_resume"] is True
        p = b["profile"]  # the same requests once more, under the profiler
        assert p["decode_passes"] > 0 and p["wall_ms_per_pass"] > 0
        assert p["device_busy_ms_per_pass"] == 0.0 and p["kernels"] == []  # no device on CPU


def test_the_bound_takes_the_cards_own_bandwidth() -> None:
    """The bound's bandwidth defaults to the card's spec figure, found by its CUDA name; a
    card not in the table is an error that names the option, never a silent H200 figure."""
    assert card_gbs("NVIDIA H200") == 4800.0
    assert card_gbs("NVIDIA H100 80GB HBM3") == 3350.0
    assert card_gbs("NVIDIA H100 NVL") == 3900.0
    assert card_gbs("NVIDIA H100 PCIe") == 2000.0
    with pytest.raises(ValueError, match=r"'NVIDIA L4'.*--hbm-gbs"):
        card_gbs("NVIDIA L4")


def test_the_command_line_sets_each_switch_and_names_the_run_after_it(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    main([
        "random-tiny", "--batch", "2", "--max-new-tokens", "4", "--device", "cpu",
        "--dtype", "float32", "--no-overlap", "--no-sample-kernel", "--no-release", "--out", str(out),
    ])  # fmt: skip
    figures = json.loads(out.read_text())
    assert figures["model"] == "random-tiny (no overlap) (eager sampler)"
    assert figures["engine_options"] == {"overlap": False, "sample_kernel": False}
    assert figures["batches"][0]["tokens"] == 8
    assert figures["timed_runs"] == 5 and len(figures["batches"][0]["decode_ms_per_pass_runs"]) == 5
    with pytest.raises(SystemExit):
        main(["random-tiny", "--timed-runs", "0"])


def test_the_sweep_refuses_no_timed_runs() -> None:
    with pytest.raises(ValueError, match="timed_runs must be at least 1, got 0"):
        run_hf_sweep("random-tiny", [2], max_new_tokens=2, device="cpu", timed_runs=0)


def test_inductor_settings_reach_the_engine_and_bad_ones_are_named() -> None:
    """``--inductor KEY=VALUE`` becomes ``engine.hf.inductor``: on CPU, where the layers are
    not compiled, the engine refuses it (so it got there); the pairs are read as JSON and
    checked against inductor's own settings before any model loads."""
    with pytest.raises(ValueError, match=r"engine\.hf\.inductor is set but the decode forward"):
        main([
            "random-tiny", "--batch", "2", "--max-new-tokens", "4", "--device", "cpu",
            "--no-release", "--inductor", "combo_kernels=true",
        ])  # fmt: skip
    assert inductor_settings(["triton.max_tiles=2", "max_autotune_gemm_backends=ATEN"]) == {
        "triton.max_tiles": 2, "max_autotune_gemm_backends": "ATEN",
    }  # fmt: skip
    assert inductor_settings(["max_autotune_gemm_backends=1"]) == {  # a str setting: as given
        "max_autotune_gemm_backends": "1"
    }
    for bad, why in (
        ("turbo=1", r"torch\._inductor\.config has no 'turbo'"),
        ("combo_kernels=False", r"'False' is a str"),
        ("combo_kernels", r"--inductor 'combo_kernels': expected KEY=VALUE"),
    ):
        with pytest.raises(ValueError, match=why):
            inductor_settings([bad])
