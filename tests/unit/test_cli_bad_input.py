"""Bad input to ``tailcut data``, ``bench``, ``rollout`` and ``replay`` gets an error naming
what is wrong and where: an output that exists (the data commands never replace a file
unless ``--force``), an empty parquet file, rows with several problems (each bad row once,
counted once), and a bad value of a validated option (the option named)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tailcut.app.cli import app
from tailcut.app.train_setup import parquet_rows
from tailcut.data.gsm8k import Prompts, make_row
from tailcut.data.verl import DataError, load_prompts, write_rows
from tailcut.train.config import DataConfig

runner = CliRunner()
WIDE = {"COLUMNS": "400", "TERMINAL_WIDTH": "400"}
"""A terminal wide enough that typer's error box wraps no message."""


def _files(root: Path) -> dict[Path, tuple[bytes, int]]:
    """Every file under ``root`` with its bytes and mtime: equal snapshots = nothing changed."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _error(args: list[str]) -> str:
    """The one-line error of a failing data command (exit 1, nothing else on stderr)."""
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0].removeprefix("error: ")


def _usage_error(args: list[str]) -> str:
    """typer's usage error (exit 2) of a bad option value, its box's lines joined."""
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 2, result.output
    return " ".join(line.strip("│ ") for line in result.output.splitlines())


# -- an output that exists -------------------------------------------------------------------


def test_convert_refuses_to_replace_an_existing_output_unless_forced(tmp_path: Path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"question": "2+2?", "answer": "4"}\n')
    out = tmp_path / "existing.parquet"
    out.write_bytes(b"the user's own file")
    before = _files(tmp_path)
    msg = _error(["data", "convert", str(src), "-o", str(out)])
    assert msg == f"{out} exists; refusing to replace it: pass --force, or choose another --out"
    assert _files(tmp_path) == before
    forced = runner.invoke(app, ["data", "convert", str(src), "-o", str(out), "--force"])
    assert forced.exit_code == 0, forced.output
    assert pq.read_table(out).num_rows == 1


def test_convert_refuses_a_dangling_link_as_output(tmp_path: Path):
    """A link whose target is missing is still a path a write would replace."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"question": "2+2?", "answer": "4"}\n')
    out = tmp_path / "link.parquet"
    out.symlink_to(tmp_path / "nowhere.parquet")
    msg = _error(["data", "convert", str(src), "-o", str(out)])
    assert msg.startswith(f"{out} exists; refusing to replace it: pass --force")
    assert out.is_symlink() and not (tmp_path / "nowhere.parquet").exists()


def _gsm8k_src(root: Path) -> Path:
    src = root / "src"
    src.mkdir()
    line = json.dumps({"question": "Q?", "answer": "so\n#### 7"})
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text(line + "\n")
    return src


@pytest.mark.parametrize(
    ("command", "written"),
    [
        (["gsm8k"], ["train.parquet", "test.parquet"]),
        (["arith", "--n", "4", "--n-test", "2"], ["train.parquet", "test.parquet", "tools.yaml"]),
        (
            ["dapo-synth", "--n", "4", "--n-test", "2"],
            ["train.parquet", "test.parquet", "tools.yaml"],
        ),
    ],
)
def test_a_second_run_into_the_same_folder_is_refused_unless_forced(
    tmp_path: Path, command: list[str], written: list[str]
):
    out = tmp_path / "out"
    args = ["data", *command, "--out", str(out)]
    if command[0] == "gsm8k":
        args += ["--src", str(_gsm8k_src(tmp_path))]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert sorted(p.name for p in out.iterdir()) == sorted(written)
    before = _files(tmp_path)
    msg = _error(args)
    assert msg == (
        f"{out}: {', '.join(written)} exist; refusing to replace them: "
        "pass --force, or choose another --out"
    )
    assert _files(tmp_path) == before
    for name in written[1:]:  # one file left of the set: named alone
        (out / name).unlink()
    msg = _error(args)
    assert msg == (
        f"{out / 'train.parquet'} exists; refusing to replace it: "
        "pass --force, or choose another --out"
    )
    forced = runner.invoke(app, [*args, "--force"])
    assert forced.exit_code == 0, forced.output
    assert sorted(p.name for p in out.iterdir()) == sorted(written)


# -- an empty file ---------------------------------------------------------------------------


def test_data_check_of_a_zero_byte_file_says_it_is_empty(tmp_path: Path):
    path = tmp_path / "empty.parquet"
    path.touch()
    assert _error(["data", "check", str(path)]) == f"{path}: the file is empty (0 bytes)"
    result = runner.invoke(app, ["data", "check", str(path), "--json"])
    assert result.exit_code == 1
    assert json.loads(result.stdout)["error"] == f"{path}: the file is empty (0 bytes)"


# -- rows with several problems --------------------------------------------------------------


def _bad_cells(tmp_path: Path) -> Path:
    """Two rows, each with two bad cells: an empty prompt and no ground truth."""
    rows = [make_row(f"Q{i}?", f"#### {i}", "train", i, Prompts()) for i in range(2)]
    for row in rows:
        row["prompt"] = []
        row["reward_model"]["ground_truth"] = None
    path = tmp_path / "badcells.parquet"
    write_rows(rows, path)
    return path


ROW_PROBLEMS = "prompt is empty (no messages); reward_model.ground_truth is missing"


def test_no_usable_rows_counts_bad_rows_and_lists_each_once(tmp_path: Path):
    """What ``tailcut train`` reads a parquet file with (bad rows skipped)."""
    path = _bad_cells(tmp_path)
    with pytest.raises(DataError) as err:
        parquet_rows(str(path), DataConfig(task="parquet"), None, None)
    assert str(err.value) == (
        f"{path}: no usable rows (2 bad row(s)):\n  row 0: {ROW_PROBLEMS}\n  row 1: {ROW_PROBLEMS}"
    )


def test_bad_rows_as_an_error_are_counted_and_listed_once(tmp_path: Path):
    path = _bad_cells(tmp_path)
    with pytest.raises(DataError) as err:
        load_prompts(path)
    assert str(err.value) == (
        f"{path}: 2 bad row(s):\n  row 0: {ROW_PROBLEMS}\n  row 1: {ROW_PROBLEMS}"
    )


def test_a_skipped_row_is_reported_once_with_all_its_problems(tmp_path: Path):
    rows = [make_row(f"Q{i}?", f"#### {i}", "train", i, Prompts()) for i in range(3)]
    rows[1]["prompt"] = []
    rows[1]["reward_model"]["ground_truth"] = None
    path = tmp_path / "one_bad.parquet"
    write_rows(rows, path)
    loaded = load_prompts(path, on_bad_row="skip")
    assert [r.row for r in loaded] == [0, 2]
    assert [str(p) for p in loaded.skipped] == [f"row 1: {ROW_PROBLEMS}"]


# -- a bad option value names the option -----------------------------------------------------


BENCH = ["bench", "--scale-cut", "0", "--no-overhead"]


def test_bench_names_the_workload_option():
    msg = _usage_error([*BENCH, "--workload", "nonsense"])
    assert "Invalid value for --workload: unknown workload 'nonsense'" in msg


def test_bench_names_the_policy_option():
    msg = _usage_error([*BENCH, "--policy", "bogus"])
    assert "Invalid value for --policy: unknown policy bogus" in msg


def test_bench_names_the_lengths_file_option(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n')
    msg = _usage_error([*BENCH, "--lengths-file", str(bad)])
    assert f"Invalid value for --lengths-file: {bad}:1: unknown key(s) ['x']" in msg
    missing = tmp_path / "missing.jsonl"
    msg = _usage_error([*BENCH, "--lengths-file", str(missing)])
    assert f"Invalid value for --lengths-file: lengths file {missing} does not exist" in msg


def test_bench_names_a_sim_engine_option():
    msg = _usage_error([*BENCH, "--preemption", "bogus"])
    assert "Invalid value for --preemption: Input should be 'recompute' or 'keep'" in msg


def test_rollout_names_the_workload_option_before_loading_a_model(tmp_path: Path):
    """Checked first: the model (here one that does not exist) is not looked at."""
    args = ["rollout", "--workload", "nonsense", "--model", str(tmp_path / "no-model")]
    msg = _usage_error(args)
    assert "Invalid value for --workload: unknown workload 'nonsense'; known: " in msg


def test_rollout_names_the_device_option_before_loading_a_model(tmp_path: Path):
    args = ["rollout", "--workload", "seed-gsm8k", "--device", "quantum",
            "--model", str(tmp_path / "no-model")]  # fmt: skip
    msg = _usage_error(args)
    assert "Invalid value for --device: unknown device 'quantum' (auto, cpu, cuda, cuda:N)" in msg


def test_replay_names_the_policy_option(tmp_path: Path):
    msg = _error(["replay", str(tmp_path), "--policy", "fastest"])
    assert msg.startswith("invalid value for --policy: unknown policy fastest; known: ")
