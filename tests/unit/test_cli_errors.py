"""The CLI's one error boundary: every expected failure is one ``error:`` line on stderr
with the exit code (2: a bad config file, override or run directory; 1: the rest), no
traceback unless ``--debug`` / ``TAILCUT_DEBUG=1``, and nothing on disk changes. A real bug
keeps its traceback."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tailcut.app.cli import app, error_line
from tailcut.config import ConfigError
from tailcut.data.verl import DataError
from tailcut.train.config import load_train_config
from tailcut.train.run_dir import (
    RunDirError,
    atomic_write_text,
    check_run_dir,
    claim_run_dir,
    experiment_hash,
)

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime (to show nothing changed)."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def _fails(args: list[str], code: int, *needles: str, env: dict[str, str] | None = None) -> str:
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# -- config files and overrides ----------------------------------------------------------


def _write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


CONFIG_CASES = {
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)), "is a binary file"),
    "latin-1": ("trainer:\n  run_dir: caf\xe9\n".encode("latin-1"), ":2: not UTF-8 text"),
    "broken-yaml": (b"trainer:\n  steps: [1, 2\n  seed: 3\n", "not valid YAML"),
    "tab-indent": (b"trainer:\n\tsteps: 3\n", ":2:1: not valid YAML"),
    "top-level-list": (b"- engine\n- data\n", "the top level must be a mapping"),
    "duplicate-key": (b"algo:\n  group_size: 4\n  group_size: 8\n", ":3: algo.group_size is given twice"),
    "bad-value": (b"data:\n  batch_size: 8\nalgo:\n  group_size: 0\n", ":4: algo.group_size:"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_a_bad_config_file_is_one_line_naming_it(tmp_path: Path, case: str) -> None:
    content, needle = CONFIG_CASES[case]
    path = _write(tmp_path / "config.yaml", content)
    run = tmp_path / "run"
    before = _tree(tmp_path)
    line = _fails(["train", str(path), f"trainer.run_dir={run}"], 2, str(path), needle)
    assert "\n" not in line
    assert _tree(tmp_path) == before and not run.exists()


def test_a_directory_or_a_missing_file_as_config(tmp_path: Path) -> None:
    before = _tree(tmp_path)
    _fails(["train", str(tmp_path)], 2, str(tmp_path), "is a directory")
    _fails(["train", str(tmp_path / "nope.yaml")], 2, "nope.yaml", "does not exist")
    assert _tree(tmp_path) == before


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("data.tools=[calculator", "override 'data.tools=[calculator': '[calculator' is not a YAML value"),
        ("trainer.steps=0", "override 'trainer.steps=0': trainer.steps:"),
        ("trainer.steps.x=1", "override 'trainer.steps.x=1': trainer.steps is a value, not a section"),
        ("algo=3", "algo:"),
        ("novalue", "is not of the form section.key=value"),
        ("trainer.run_dir=", "trainer.run_dir: empty"),
    ],
)  # fmt: skip
def test_a_bad_override_is_one_line_naming_it(tmp_path: Path, override: str, needle: str) -> None:
    config = ROOT / "configs" / "arith-tiny.yaml"
    before = _tree(tmp_path)
    _fails(["train", str(config), f"trainer.run_dir={tmp_path / 'run'}", override], 2, needle)
    assert _tree(tmp_path) == before


def test_validation_errors_name_the_line_and_the_override(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", b"trainer:\n  steps: 0\nalgo:\n  loss_agg: mean\n")
    with pytest.raises(ConfigError) as err:
        load_train_config(path, ["algo.group_size=0"])
    text = str(err.value)
    assert "\n" not in text and text.startswith("invalid configuration (3 errors): ")
    assert f"{path}:2: trainer.steps:" in text and "allowed: 1 <= x <= 10000000 (got 0)" in text
    assert f"{path}:4: algo.loss_agg: Input should be 'token-mean'" in text
    assert "override 'algo.group_size=0': algo.group_size:" in text


# -- the run directory -------------------------------------------------------------------


def _cfg(run: Path | str, *over: str):
    return load_train_config(
        None,
        [
            "engine.kind=hf",
            "trainer.loggers=[]",
            f"trainer.run_dir={run}",
            "data.batch_size=2",
            *over,
        ],
    )


def test_the_current_directory_is_refused_as_run_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = ROOT / "configs" / "arith-tiny.yaml"
    for value in (".", str(tmp_path), f"{tmp_path}/"):
        _fails(["train", str(config), f"trainer.run_dir={value}"], 2, "is the current directory")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("files", "needle"),
    [
        ({"config.yaml": "my: own config\n"}, "holds files that are not a tailcut run (config.yaml"),
        ({"notes.txt": "x", "metrics.jsonl": ""}, "(notes.txt; no run.json)"),
        ({"run.json": "{not json"}, "run.json is damaged"),
    ],
)  # fmt: skip
def test_a_directory_of_other_files_is_refused(tmp_path: Path, files, needle) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for name, text in files.items():
        (run / name).write_text(text)
    before = _tree(tmp_path)
    config = ROOT / "configs" / "arith-tiny.yaml"
    _fails(["train", str(config), f"trainer.run_dir={run}"], 2, str(run), needle)
    assert _tree(tmp_path) == before


def test_a_file_as_run_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("x")
    with pytest.raises(RunDirError, match="is a file"):
        check_run_dir(_cfg(tmp_path / "run"))


def test_a_run_dir_remembers_its_experiment(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = _cfg(run)
    said: list[str] = []
    claim_run_dir(check_run_dir(cfg), cfg, said.append)
    record = json.loads((run / "run.json").read_text())
    assert record["experiment_hash"] == experiment_hash(record["experiment"]) and not said
    assert record["experiment"]["algo.group_size"] == cfg.algo.group_size
    # What may change when a run is continued: steps, cadences, loggers, devices, workers.
    same = _cfg(
        run, "trainer.steps=99", "trainer.val_every=1", "trainer.save_every=3",
        "trainer.loggers=[console]", "actor.device=cpu", "engine.device=cpu",
        "rollout.workers=2", "actor.threads=1", "trainer.keep_checkpoints=5",
    )  # fmt: skip
    assert check_run_dir(same).changes == ()
    # What makes it another experiment: refused, naming the field, nothing written.
    before = _tree(tmp_path)
    for over, field in [
        ("algo.group_size=8", "algo.group_size: 4 → 8"),
        ("trainer.seed=1", "trainer.seed: 0 → 1"),
        ("engine.model=/elsewhere", "engine.model: 'builtin' → '/elsewhere'"),
        ("cutoff.abort_ratio=0.3", "cutoff.abort_ratio"),
        ("agent.max_turns=2", "agent.max_turns"),
        ("data.shuffle=false", "data.shuffle"),
        ("actor.lr=0.01", "actor.lr"),
    ]:
        with pytest.raises(RunDirError, match="different experiment") as err:
            check_run_dir(_cfg(run, over))
        assert field in str(err.value) and "trainer.resume=force" in str(err.value)
    assert _tree(tmp_path) == before
    forced = _cfg(run, "algo.group_size=8", "trainer.resume=force")
    plan = check_run_dir(forced)
    assert plan.changes == ("algo.group_size: 4 → 8",)
    claim_run_dir(plan, forced, said.append)
    assert "trainer.resume=force" in said[0] and (run / "config.previous.yaml").is_file()
    record = json.loads((run / "run.json").read_text())
    assert record["experiment"]["algo.group_size"] == 8 and record["forced"][0]["changes"]


def test_config_yaml_is_not_overwritten_silently(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _cfg(run, "trainer.steps=5")
    claim_run_dir(check_run_dir(first), first, lambda _: None)
    original = (run / "config.yaml").read_text()
    said: list[str] = []
    claim_run_dir(check_run_dir(first), first, said.append)  # the same config: no note
    assert said == [] and not (run / "config.previous.yaml").exists()
    longer = _cfg(run, "trainer.steps=9")
    claim_run_dir(check_run_dir(longer), longer, said.append)
    assert len(said) == 1 and "trainer.steps: 5 → 9" in said[0]
    assert (run / "config.previous.yaml").read_text() == original
    assert load_train_config(run / "config.yaml", []).trainer.steps == 9
    assert not [p for p in run.iterdir() if ".tmp-" in p.name]


def test_a_run_made_before_run_json_is_still_recognised(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    cfg = _cfg(run)
    import yaml

    (run / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    (run / "metrics.jsonl").write_text('{"step":0}\n')
    assert check_run_dir(cfg).changes == ()
    with pytest.raises(RunDirError, match=r"algo\.group_size: 4 → 2"):
        check_run_dir(_cfg(run, "algo.group_size=2"))


def test_resume_never_over_checkpoints_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = _cfg(run, "trainer.resume=never")
    claim_run_dir(check_run_dir(cfg), cfg, lambda _: None)
    (run / "checkpoints" / "step_00000003").mkdir(parents=True)
    (run / "checkpoints" / "step_00000003" / "DONE").write_text("3\n")
    with pytest.raises(RunDirError, match=r"trainer\.resume=never: .* holds checkpoints"):
        check_run_dir(cfg)
    assert check_run_dir(_cfg(run)).path == run  # auto continues it


def test_atomic_write_leaves_the_old_file_or_the_new(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "f.txt"
    atomic_write_text(path, "old\n")

    def broken(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError) as err:
        atomic_write_text(path, "new\n")
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


# -- the boundary itself -----------------------------------------------------------------


def test_os_errors_are_one_line_naming_the_path() -> None:
    cases = [
        (OSError(errno.ENOSPC, "No space left on device", "/r/ck/actor.pt"), "disk full: /r/ck/actor.pt; free some space"),
        (OSError(errno.EROFS, "Read-only file system", "/r/x"), "read-only file system: /r/x; use a writable directory"),
        (PermissionError(errno.EACCES, "Permission denied", "/r/y"), "permission denied: /r/y"),
        (FileNotFoundError(errno.ENOENT, "No such file", "/d.parquet"), "no such file or directory: /d.parquet"),
        (OSError(errno.ENOSPC, "No space left on device"), "disk full: (no file named)"),
    ]  # fmt: skip
    for exc, text in cases:
        found = error_line(exc)
        assert found is not None and found[1] == 1 and found[0].startswith(text), (exc, found)
    assert error_line(ConnectionResetError(errno.ECONNRESET, "reset")) is None  # no file: a bug


def test_expected_errors_and_groups() -> None:
    assert error_line(ConfigError("a\n  b")) == ("a; b", 2)
    assert error_line(DataError("data.parquet:3: bad row")) == ("data.parquet:3: bad row", 1)
    group = ExceptionGroup("g", [DataError("one"), ExceptionGroup("h", [DataError("two")])])
    assert error_line(group) == ("one (and 1 more errors)", 1)
    assert error_line(ExceptionGroup("g", [DataError("one"), KeyError("bug")])) is None
    assert error_line(KeyError("x")) is None and error_line(ValueError("x")) is None


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    args = ["train", str(tmp_path)]
    for extra, env in ((["--debug"], None), ([], {"TAILCUT_DEBUG": "1"})):
        result = runner.invoke(app, [*extra, *args], env=env)
        assert isinstance(result.exception, ConfigError), result.output
        assert "error: " not in result.stderr
    _fails(args, 2, "is a directory", env={"TAILCUT_DEBUG": "0"})


def test_a_missing_model_is_one_line_exit_1(tmp_path: Path) -> None:
    _fails(["model", "path", str(tmp_path / "none")], 1, "no such directory")
    _fails(["model", "path", str(tmp_path)], 1, "config.json is missing")
    (tmp_path / "config.json").write_text("{broken")
    before = _tree(tmp_path)
    _fails(["model", "path", str(tmp_path)], 1, "config.json is not valid JSON")
    assert _tree(tmp_path) == before


PLANTED_BUG = """
import tailcut.app.commands.model as m
def resolve_model(spec):
    return {}["planted"]
m.resolve_model = resolve_model
from tailcut.app.cli import main
main(["model", "path", "builtin"])
"""


def test_a_real_bug_keeps_its_traceback() -> None:
    result = runner.invoke(app, ["model", "path", "x"], catch_exceptions=True)
    assert result.exit_code == 1  # an expected error: one line
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-c", PLANTED_BUG], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "KeyError" in proc.stderr and "planted" in proc.stderr
    assert "error: " not in proc.stderr
