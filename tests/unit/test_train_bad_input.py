"""Bad input to ``tailcut train`` is one ``error:`` line naming what is wrong and where,
refused before the model is built or loaded: an unknown device, a device that is not here,
an empty config file, a run directory that cannot be made, a tool-config file that is not
YAML, an unknown key (with the closest valid one). The model here is a directory that does
not exist: an input refused only once the model is resolved would name ``engine.model``
instead."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tailcut.app.cli import app
from tailcut.config import ConfigError
from tailcut.tools.registry import ToolConfigError
from tailcut.train.config import load_train_config

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "arith-tiny.yaml")


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))}


def _train(tmp_path: Path, *args: str, config: str | None = CONFIG) -> tuple[int, str, str]:
    """``tailcut train`` on a model that is not there (never reached by what is refused
    first); exit code, stdout, the one ``error:`` line."""
    no_model = f"engine.model={tmp_path / 'no-model'}"
    head = [config] if config is not None else []
    result = runner.invoke(app, ["train", *head, no_model, *args])
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (result.stderr, result.exception)
    assert "Traceback" not in result.output
    return result.exit_code, result.stdout, lines[0]


# -- devices -----------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["engine.device", "actor.device"])
def test_an_unknown_device_is_a_config_error_naming_the_field(tmp_path: Path, field: str) -> None:
    code, _, line = _train(tmp_path, f"trainer.run_dir={tmp_path / 'run'}", f"{field}=quantum")
    assert code == 2
    assert f"override '{field}=quantum': {field}: unknown device 'quantum'" in line, line
    assert "(auto, cpu, cuda, cuda:N)" in line
    assert not (tmp_path / "run").exists()


def test_devices_in_a_config_file_are_checked_with_their_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  kind: hf\nactor:\n  device: cuda:x\n")
    with pytest.raises(ConfigError, match=rf"{path}:4: actor\.device: unknown device 'cuda:x'"):
        load_train_config(path, [])
    for good in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        cfg = load_train_config(None, [f"engine.device={good}", f"actor.device={good}"])
        assert cfg.engine.device == cfg.actor.device == good


@pytest.mark.parametrize("field", ["actor.device", "engine.device"])
def test_cuda_asked_for_and_absent_is_one_line_before_the_model(tmp_path: Path, field: str) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    code, _, line = _train(tmp_path, f"trainer.run_dir={tmp_path / 'run'}", f"{field}=cuda")
    assert code == 2
    assert line == f"error: {field}: 'cuda' requested but CUDA is not available", line


# -- config files --------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n  \n", "# all commented out\n# trainer:\n", "---\n"])
def test_an_empty_config_file_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    code, _, line = _train(tmp_path, f"trainer.run_dir={tmp_path / 'run'}", config=str(path))
    assert code == 2
    assert line.startswith(f"error: config file {path} is empty"), line
    assert not (tmp_path / "run").exists()


def test_no_config_file_says_the_defaults_are_used(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    code, out, line = _train(tmp_path, f"trainer.run_dir={tmp_path / 'afile' / 'run'}", config=None)
    assert "no config file given" in out and "default" in out, out
    assert code == 2 and "trainer.run_dir=" in line


# -- the run directory ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("run_dir", "needle"),
    [
        ("/proc/nope/run", "trainer.run_dir=/proc/nope/run: cannot create /proc/nope"),
        ("{tmp}/afile/run", "trainer.run_dir={tmp}/afile/run: {tmp}/afile is a file"),
        ("{tmp}/afile/deeper/run", "trainer.run_dir={tmp}/afile/deeper/run: {tmp}/afile is a file"),
    ],
)  # fmt: skip
def test_a_run_dir_that_cannot_be_made_is_refused_before_the_model(
    tmp_path: Path, run_dir: str, needle: str
) -> None:
    """... and checking one that can be made leaves nothing behind: it is made and removed
    again, so a run refused later (here: its model is missing) leaves no empty directories."""
    if run_dir.startswith("/proc") and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    (tmp_path / "afile").write_text("x")
    before = _tree(tmp_path)
    code, _, line = _train(tmp_path, f"trainer.run_dir={run_dir.format(tmp=tmp_path)}")
    assert code == 2
    assert needle.format(tmp=tmp_path) in line, line
    assert _tree(tmp_path) == before
    code, _, line = _train(tmp_path, f"trainer.run_dir={tmp_path / 'a' / 'b' / 'run'}")
    assert code == 1 and "engine.model" in line and "no-model" in line, line
    assert _tree(tmp_path) == before


# -- the tool config ------------------------------------------------------------------------

BAD_YAML = "tools:\n  - class_name: tailcut.tools.calculator.CalculatorTool\n   config: {}\n"


def test_bad_yaml_in_the_tool_config_is_file_line_col_before_the_model(tmp_path: Path) -> None:
    tools = tmp_path / "tools.yaml"
    tools.write_text(BAD_YAML)
    code, _, line = _train(
        tmp_path, f"trainer.run_dir={tmp_path / 'run'}", f"data.tool_config={tools}"
    )
    assert code == 1
    assert line.startswith(f"error: {tools}:3:4: not valid YAML: "), line
    assert '"<unicode string>"' not in line


def test_a_tool_config_is_checked_without_building_its_tools(tmp_path: Path) -> None:
    from tailcut.tools.registry import check_tool_config

    path = tmp_path / "tools.yaml"
    path.write_text(BAD_YAML)
    with pytest.raises(ToolConfigError, match=rf"^{path}:3:4: not valid YAML"):
        check_tool_config(path)
    path.write_text("tools:\n  - class_name: tailcut.tools.nope.Nope\n")
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.class_name: cannot import"):
        check_tool_config(path)
    path.write_text("tools:\n  - class_name: tailcut.tools.calculator.CalculatorTool\n")
    check_tool_config(path)


# -- unknown keys ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("cutoff:\n  policy: target-count\n  abrot_ratio: 0.2\n",
         "c.yaml:3: cutoff.abrot_ratio: unknown key; did you mean 'abort_ratio'?"),
        ("enigne:\n  kind: hf\n", "c.yaml:1: enigne: unknown key; did you mean 'engine'?"),
        ("engine:\n  kind: hf\n  sim:\n    zzz: 1\n",
         "c.yaml:4: engine.sim.zzz: unknown key; engine.sim has: decode_a_s, decode_c_s"),
    ],
)  # fmt: skip
def test_an_unknown_key_says_so_and_suggests_the_closest(
    tmp_path: Path, text: str, needle: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_train_config(path, [])
    assert needle in str(err.value), str(err.value)
    assert "Extra inputs" not in str(err.value)
    with pytest.raises(
        ConfigError,
        match=r"override 'trainer\.seeed=1': trainer\.seeed: unknown key; did you mean 'seed'\?",
    ):
        load_train_config(None, ["trainer.seeed=1"])
