"""``tailcut train`` on the embedded engine for every family it runs: one step of a tiny
random-init model (``hf_families``, saved with the built-in chat tokenizer), the weight
sync included. The engine's log-probs equal the actor's (same masks, windows and
soft-capping on both sides: ``train/mismatch_kl`` ~ 0), and an architecture the engine
cannot run stops the command before anything is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hf_families import FAMILIES, tiny_model
from tailcut.app.cli import app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _args(model: Path, run_dir: Path) -> list[str]:
    return [
        "train", "engine.kind=hf", f"engine.model={model}", "engine.device=cpu",
        "engine.dtype=float32", "engine.max_batch_size=8", "engine.hf.max_seq_len=512",
        "data.batch_size=2", "algo.group_size=2", "data.train_size=8", "data.val_size=0",
        "agent.max_turns=1", "agent.max_new_tokens=16", "agent.max_response_tokens=32",
        "cutoff.policy=wait-all", "actor.mini_batches=1", "actor.device=cpu", "actor.threads=1",
        "trainer.steps=1", "trainer.val_every=0", "trainer.save_every=0",
        "trainer.loggers=[jsonl]", f"trainer.run_dir={run_dir}",
    ]  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_train_step_with_weight_sync(family: str, tmp_path: Path, chat_tokenizer: Any) -> None:
    tok = chat_tokenizer
    model = tiny_model(
        family, len(tok), hidden=32, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, _args(tmp_path / "model", run_dir))
    assert result.exit_code == 0, result.output + repr(result.exception)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows if r["step"] > 0]
    assert step["sync/version"] == 1.0
    assert step["train/loss_tokens"] > 0
    assert step["train/mismatch_kl"] < 1e-5, family  # engine and actor log-probs agree


def test_a_model_the_engine_cannot_run_stops_train_with_the_reason(tmp_path: Path) -> None:
    import transformers

    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2)
    config.save_pretrained(tmp_path / "model")  # no weights: refused from config.json alone
    result = CliRunner().invoke(app, _args(tmp_path / "model", tmp_path / "run"))
    assert result.exit_code == 1
    assert "cannot run MambaForCausalLM" in result.output
    assert "engine.kind=vllm or engine.kind=sglang" in result.output
