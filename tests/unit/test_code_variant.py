"""The built-in code-interpreter variant: its recipe and hash, its task, the build pipeline
(on a tiny recipe: the real one takes minutes), ``model init --variant code`` and the
``builtin-code`` model spec."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fakes.tiny_code_model import TINY_CODE
from tailcut.app.cli import app
from tailcut.app.commands.model import VARIANT_NAMES
from tailcut.chat.template import CHAT_TEMPLATE
from tailcut.data import dapo_synth as ds
from tailcut.models import build
from tailcut.models.code_eval import run_program
from tailcut.models.resolve import BUILTINS, resolve_model, verify_build
from tailcut.models.tasks import CodeTask


def test_variants_the_cli_and_the_specs_agree():
    assert set(VARIANT_NAMES) == set(build.VARIANTS) == set(BUILTINS.values())
    assert {name: r.variant for name, r in build.VARIANTS.items()} == {
        "arith": "arith",
        "code": "code",
        "qwen2-0.5b": "arith",  # random-init size presets: the arithmetic task's tokenizer
        "qwen2-1.5b": "arith",
        "qwen2-3b": "arith",
    }
    assert build.VARIANTS["arith"] == build.ModelRecipe()


def test_the_default_hash_is_the_one_from_before_variants():
    """Adding ``variant`` must not invalidate every cached default build."""
    old = build.ModelRecipe().model_dump(mode="json")
    for name in ("variant", *build.ADDED_FIELDS):  # fields added since, at their defaults
        del old[name]
    payload = json.dumps(
        {"recipe": old, "template": CHAT_TEMPLATE, "version": build.BUILD_VERSION}, sort_keys=True
    )
    assert (
        build.recipe_hash(build.ModelRecipe()) == hashlib.sha256(payload.encode()).hexdigest()[:16]
    )
    assert build.recipe_hash(build.VARIANTS["code"]) != build.recipe_hash(build.ModelRecipe())


def test_the_evaluator_runs_exactly_the_task_s_programs():
    for p in ds.generate_problems(5, 200):
        values = p.values
        for i, step in enumerate(p.steps):
            assert run_program(step.program(values[i])) == str(values[i + 1])
    assert run_program("n = 5\nprint(n * n)") is None
    assert run_program("import os\nprint(os.getcwd())") is None
    assert run_program("n = 5\nprint(pow(3, n, 0))") is None


def test_the_task_renders_code_calls_keyed_by_the_first_operation():
    task = CodeTask(max_steps=3, tail_alpha=1.0, strict_items=2)
    problems = task.problems(0, 100)
    assert max(len(p.steps) for p in problems) <= 3
    common = {p.steps[0].op for p in problems if task.common(p)}
    assert common == {ds.OPS[0].name, ds.OPS[1].name}
    assert task.tools()[0]["function"]["name"] == "code_interpreter"


@pytest.fixture(scope="module")
def tiny_code(tmp_path_factory: pytest.TempPathFactory) -> build.BuildResult:
    return build.ensure_built(TINY_CODE, tmp_path_factory.mktemp("model") / "code")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_pipeline_builds_a_verified_model_that_renders_code_calls(tiny_code):
    from transformers import AutoTokenizer

    assert verify_build(tiny_code.path, build.recipe_hash(TINY_CODE)) is None
    info = tiny_code.info
    assert info["recipe"]["variant"] == "code"
    assert {"accuracy", "tool_calls", "tool_calls_run_share"} <= set(info)
    tok: Any = AutoTokenizer.from_pretrained(tiny_code.path)
    problem = ds.generate_problems(1, 1)[0]
    text = tok.apply_chat_template(ds.conversation(problem), tools=ds.tools(), tokenize=False)
    assert '"name": "code_interpreter"' in text and "Answer: " in text
    # The call tags are single tokens, the program's text round-trips.
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<tool_call>") in ids


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_init_variant_code_and_the_builtin_code_spec(
    tiny_code, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TAILCUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(build.VARIANTS, "code", TINY_CODE)
    cached = build.default_model_dir(TINY_CODE)
    cached.parent.mkdir(parents=True)
    import shutil

    shutil.copytree(tiny_code.path, cached)  # as if `model init --variant code` had run
    assert resolve_model("builtin-code") == cached
    out = CliRunner().invoke(app, ["model", "init", "--variant", "code", "--json"])
    assert out.exit_code == 0, out.output
    shown = json.loads(out.stdout.strip().splitlines()[-1])
    assert shown["cached"] is True and shown["recipe"]["variant"] == "code"
    bad = CliRunner().invoke(app, ["model", "init", "--variant", "vision"])
    assert bad.exit_code != 0 and "is not one of arith, code" in bad.output


@pytest.mark.parametrize("variant", ["arith", "code"])
def test_a_build_is_scored_on_problems_it_was_not_fine_tuned_on(variant: str) -> None:
    recipe = build.VARIANTS[variant]
    task = build._task(recipe)
    sft = {p.question for p in build._sft_problems(recipe)}
    held_out = task.held_out(recipe.eval_seed, recipe.eval_problems, build._sft_problems(recipe))
    assert len(held_out) == recipe.eval_problems
    assert not [p for p in held_out if p.question in sft]
    if variant == "code":  # drawn independently, short problems repeat the fine-tuning set's
        drawn = task.problems(recipe.eval_seed, recipe.eval_problems)
        assert sum(p.question in sft for p in drawn) > recipe.eval_problems // 10
