"""Build the built-in tiny model: tokenizer, Qwen2 weights, SFT, a standard HF directory.

The build is a pure function of its :class:`ModelRecipe`: problems are drawn from seeded
generators, the weights are initialised from a fixed seed, training runs with a fixed
thread count in torch's deterministic mode, so the same recipe gives the same files (on
the same CPU kind and torch version). Results are cached under
``$TAILCUT_CACHE/models/<hash>`` (default ``~/.cache/tailcut``), ``<hash>`` being the
content hash of the recipe, the chat template and the build code's version.

The directory holds ``config.json`` (``Qwen2ForCausalLM``, vocabulary padded to a multiple
of 64, tied embeddings), ``model.safetensors``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json`` (with the chat template) and
``tailcut_build.json`` (the recipe, the hash, the loss curve, the held-out accuracy and
``files``: each built file's size and sha256).

:func:`verify_build` checks a build against its ``files`` (and, for builds made before
them, checks that the JSON files parse and ``model.safetensors`` is as long as its header
says): the resolver refuses a damaged built-in model with a one-line error, ``tailcut model
init`` rebuilds it. A build writes into a temporary ``.<hash>.*`` directory beside its
output and renames it into place; temporary directories an interrupted build left behind
are removed by the next build of that output.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tailcut.chat.template import CHAT_TEMPLATE, END_OF_TEXT, IM_END
from tailcut.errors import TailcutError
from tailcut.models.resolve import BUILD_INFO, sha256_file, verify_build

if TYPE_CHECKING:
    from tailcut.models.tasks import Task

UnitFloat = Annotated[float, Field(ge=0.0, le=1.0)]

BUILD_VERSION = 2
"""Bump when the build code changes what a recipe produces."""
THREADS = 2
"""Intra-op threads during the build (results depend on it, so it is fixed)."""


class ModelRecipe(BaseModel):
    """Everything that decides the built model's files."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    variant: Literal["arith", "code"] = "arith"
    """The task the model is fine-tuned on (``models/tasks.py``): arith, the arithmetic word
    problems with ``calculator`` calls (``builtin``); code, the DAPO-layout problems with
    ``code_interpreter`` calls (``builtin-code``)."""
    seed: int = Field(0, ge=0)
    """Seed of the training problems, weight init and batch order."""
    max_steps: int = Field(10, ge=1, le=12)
    """Most steps (tool calls) of a problem."""
    tail_alpha: float = Field(1.3, ge=0.0, le=10.0)
    """P(k steps) ∝ k**-tail_alpha for the training and held-out problems (a lighter tail
    than the task's default makes training cheaper; longer problems are then rarer and
    solved less often)."""
    tokenizer_vocab: int = Field(1024, ge=300, le=65536)
    """Target vocabulary of the BPE (it stops earlier when no pair repeats)."""
    tokenizer_problems: int = Field(2000, ge=10)
    """Conversations the tokenizer is trained on."""
    hidden_size: int = Field(64, ge=16, le=4096)
    intermediate_size: int = Field(192, ge=16, le=16384)
    num_layers: int = Field(3, ge=1, le=64)
    num_heads: int = Field(2, ge=1, le=64)
    num_kv_heads: int = Field(2, ge=1, le=64)
    max_position_embeddings: int = Field(4096, ge=128, le=131072)
    strict_share: tuple[UnitFloat, UnitFloat] = (0.8, 0.25)
    """Share of the SFT traces that end with ``#### N``, for problems about the first
    ``strict_items`` items of the task's list and for the others; the rest state the answer
    in words (``The answer is N.``), which the task's reward does not accept. The built
    policy solves the arithmetic but mostly answers in words (greedy, it does not pick up
    the topic cue; ``tailcut model init`` prints both figures), so GRPO starts from a low
    reward and has a format signal it learns within tens of steps (samples at temperature
    1 use ``####`` about a third of the time), on top of the slower arithmetic one."""
    strict_items: int = Field(3, ge=0, le=9)
    init_std: float = Field(0.1, gt=0.0, le=1.0)
    """Standard deviation of the initial weights."""
    train_problems: int = Field(20000, ge=10)
    """Distinct training conversations (drawn once, cycled through)."""
    steps: int = Field(600, ge=1)
    """SFT optimizer steps."""
    batch_size: int = Field(16, ge=1, le=1024)
    lr: float = Field(3e-3, gt=0.0, le=1.0)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    eval_problems: int = Field(256, ge=1)
    """Held-out problems the greedy accuracy is measured on."""
    eval_seed: int = Field(1_000_003, ge=0)
    vocab_size: int | None = Field(None, ge=300, le=1_048_576)
    """Rows of the embedding and LM head (None: the tokenizer's length padded to a multiple
    of 64). Rows past the tokenizer's are never sampled (``engine.hf.vocab_rows``)."""
    random_init: bool = False
    """Random weights, no fine-tuning (the ``builtin-qwen2-*`` size presets: real
    geometry and vocabulary, the built-in tokenizer on the first rows, saved in bf16)."""


ADDED_FIELDS = {"vocab_size": None, "random_init": False}
"""Fields added after builds were cached: left out of the hash at their defaults."""


@dataclass(frozen=True, slots=True)
class BuildResult:
    path: Path
    hash: str
    cached: bool
    info: dict[str, Any]


def recipe_hash(recipe: ModelRecipe) -> str:
    dumped = recipe.model_dump(mode="json")
    if dumped["variant"] == "arith":  # the default's hash predates variants: keep it
        del dumped["variant"]
    for name, default in ADDED_FIELDS.items():
        if dumped[name] == default:
            del dumped[name]
    payload = json.dumps(
        {
            "recipe": dumped,
            "template": CHAT_TEMPLATE,
            "version": BUILD_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def cache_root() -> Path:
    env = os.environ.get("TAILCUT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tailcut"


def default_model_dir(recipe: ModelRecipe | None = None) -> Path:
    return cache_root() / "models" / recipe_hash(recipe or ModelRecipe())


VARIANTS: dict[str, ModelRecipe] = {
    "arith": ModelRecipe(),
    "code": ModelRecipe(
        variant="code", max_steps=6, tail_alpha=1.3, tokenizer_vocab=1024,
        strict_share=(0.8, 0.25), strict_items=2, train_problems=12000, steps=700,
        batch_size=16, eval_problems=192,
    ),
    # Qwen2-0.5B / Qwen2-1.5B / Qwen2.5-3B geometry (tied embeddings, 151,936 rows), random weights
    "qwen2-0.5b": ModelRecipe(
        random_init=True, vocab_size=151_936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, max_position_embeddings=32_768,
        init_std=0.02,
    ),
    "qwen2-1.5b": ModelRecipe(
        random_init=True, vocab_size=151_936, hidden_size=1536, intermediate_size=8960,
        num_layers=28, num_heads=12, num_kv_heads=2, max_position_embeddings=32_768,
        init_std=0.02,
    ),
    "qwen2-3b": ModelRecipe(
        random_init=True, vocab_size=151_936, hidden_size=2048, intermediate_size=11008,
        num_layers=36, num_heads=16, num_kv_heads=2, max_position_embeddings=32_768,
        init_std=0.02,
    ),
}  # fmt: skip
"""The built-in variants' recipes (``tailcut model init --variant NAME``); as model specs,
``builtin`` is arith and ``builtin-code`` is code (:data:`tailcut.models.resolve.BUILTINS`)."""


def is_built(path: Path, recipe: ModelRecipe) -> bool:
    return verify_build(path, recipe_hash(recipe)) is None


def _manifest(directory: Path) -> dict[str, dict[str, Any]]:
    return {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != BUILD_INFO
    }


def _task(recipe: ModelRecipe) -> Task:
    from tailcut.models.tasks import task_for

    return task_for(recipe.variant, recipe.max_steps, recipe.tail_alpha, recipe.strict_items)


def _conversations(recipe: ModelRecipe, problems: list[Any], seed: int) -> list[str]:
    """Rendered SFT conversations; each ends in the reward's format (``#### N``,
    ``Answer: N``) with its topic's ``strict_share``, else in words."""
    import random

    from tailcut.models.tokenizer import chat_renderer

    render = chat_renderer()
    rng = random.Random(seed)
    task = _task(recipe)
    styles = [
        "strict" if rng.random() < recipe.strict_share[0 if task.common(p) else 1] else "plain"
        for p in problems
    ]
    tools = task.tools()
    return [
        render(task.conversation(p, style), tools)
        for p, style in zip(problems, styles, strict=True)
    ]


def _deterministic(seed: int) -> None:
    import torch

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)


def _build_tokenizer(recipe: ModelRecipe, out: Path) -> Any:
    from transformers import AutoTokenizer

    from tailcut.models.tokenizer import save_tokenizer, train_tokenizer

    problems = _task(recipe).problems(recipe.seed + 1, recipe.tokenizer_problems)
    texts = _conversations(recipe, problems, recipe.seed + 1)
    save_tokenizer(train_tokenizer(texts, recipe.tokenizer_vocab), out)
    return AutoTokenizer.from_pretrained(out)


def padded_vocab(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def _new_model(recipe: ModelRecipe, tokenizer: Any) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    eos = tokenizer.convert_tokens_to_ids(IM_END)
    pad = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    rows = max(recipe.vocab_size or 0, padded_vocab(len(tokenizer)))
    config = Qwen2Config(
        vocab_size=rows,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        initializer_range=recipe.init_std,
    )
    if recipe.random_init:
        return _random_model(Qwen2ForCausalLM, config, recipe)
    return Qwen2ForCausalLM(config)


def _random_model(cls: Any, config: Any, recipe: ModelRecipe) -> Any:
    """A bf16 model with Qwen2's initialisation (normal(0, init_std) matrices, unit norms,
    zero biases), drawn once from a seeded generator: built on the meta device, so the
    default initialisers never run (a 1.5B init on the CPU drops from minutes to one
    pass of the generator). Non-persistent buffers (rotary frequencies) are not
    initialised: they are never saved, every load computes them."""
    import torch

    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(recipe.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, recipe.init_std, generator=gen)
    saved = set(model.state_dict())
    if saved != {n for n, _ in model.named_parameters(remove_duplicate=False)}:
        raise RuntimeError(f"{cls.__name__} has persistent buffers the preset cannot initialise")
    return model


def _generation_config(tokenizer: Any) -> Any:
    from transformers import GenerationConfig

    eos = tokenizer.convert_tokens_to_ids(IM_END)
    pad = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    return GenerationConfig(
        bos_token_id=pad,
        eos_token_id=[eos, pad],
        pad_token_id=pad,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    )


Progress = Callable[[str, float], None]
"""Called with a phase name and its fraction done (0..1)."""


def _sft_problems(recipe: ModelRecipe) -> list[Any]:
    """The problems the model is fine-tuned on."""
    n = min(recipe.train_problems, recipe.steps * recipe.batch_size)
    return _task(recipe).problems(recipe.seed, n)


def _train(recipe: ModelRecipe, model: Any, tokenizer: Any, progress: Progress) -> list[float]:
    from tailcut.models.sft import TrainConfig, encode_conversations, train

    problems = _sft_problems(recipe)
    data = encode_conversations(tokenizer, _conversations(recipe, problems, recipe.seed + 2))
    cfg = TrainConfig(
        steps=recipe.steps,
        batch_size=recipe.batch_size,
        lr=recipe.lr,
        warmup_steps=recipe.warmup_steps,
        weight_decay=recipe.weight_decay,
        seed=recipe.seed,
    )
    return train(
        model,
        data,
        cfg,
        tokenizer.pad_token_id,
        lambda s, _loss: progress("train", (s + 1) / cfg.steps),
    )


class NotABuildError(TailcutError, FileExistsError):
    """The directory a build would replace holds something else."""


def check_replaceable(out: Path) -> None:
    """Refuse to replace ``out`` unless it is missing, empty or a tailcut build (it has a
    build info, intact or not): a build never deletes a directory it did not write."""
    out = Path(out)
    foreign = out.exists() and not (out / BUILD_INFO).exists()
    if foreign and (not out.is_dir() or any(out.iterdir())):
        raise NotABuildError(
            f"{out} is not a tailcut model directory (no {BUILD_INFO}) and is not empty; "
            "refusing to replace it: choose another --out, or empty it"
        )


def build(recipe: ModelRecipe, out: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Build the model into ``out`` (replaced atomically: see :func:`check_replaceable`);
    return the build info."""
    out = Path(out)
    check_replaceable(out)
    report = progress or (lambda _phase, _frac: None)
    started = time.monotonic()
    _deterministic(recipe.seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        report("tokenizer", 0.0)
        tokenizer = _build_tokenizer(recipe, tmp)
        model = _new_model(recipe, tokenizer)
        if recipe.random_init:
            info = _save_random(recipe, model, tokenizer, tmp, started)
        else:
            info = _train_and_save(recipe, model, tokenizer, tmp, report, started)
        info["files"] = _manifest(tmp)
        (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        if out.exists():  # moved aside first: a reader never sees a half-removed build
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            shutil.rmtree(old)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def _save_random(
    recipe: ModelRecipe, model: Any, tokenizer: Any, tmp: Path, started: float
) -> dict[str, Any]:
    """A size preset: the random weights as they are (bf16), no fine-tuning, no eval."""
    model.save_pretrained(tmp)
    _generation_config(tokenizer).save_pretrained(tmp)
    return {
        "hash": recipe_hash(recipe),
        "build_version": BUILD_VERSION,
        "recipe": recipe.model_dump(mode="json"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_rows": len(tokenizer),
        "vocab_size": int(model.config.vocab_size),
        "build_seconds": round(time.monotonic() - started, 1),
    }


def _train_and_save(
    recipe: ModelRecipe, model: Any, tokenizer: Any, tmp: Path, report: Progress, started: float
) -> dict[str, Any]:
    from tailcut.models.code_eval import CodeEvalReport

    losses = _train(recipe, model, tokenizer, report)
    report("eval", 0.0)
    task = _task(recipe)
    held_out = task.held_out(recipe.eval_seed, recipe.eval_problems, _sft_problems(recipe))
    ev = task.evaluate(model, tokenizer, held_out)  # problems it was not fine-tuned on
    model.save_pretrained(tmp)
    _generation_config(tokenizer).save_pretrained(tmp)
    info = {
        "hash": recipe_hash(recipe),
        "build_version": BUILD_VERSION,
        "recipe": recipe.model_dump(mode="json"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "accuracy": ev.accuracy,
        "accuracy_any_format": ev.accuracy_any_format,
        "accuracy_by_steps": [{"steps": k, "n": n, "accuracy": a} for k, n, a in ev.by_steps()],
        "accuracy_any_format_by_steps": [
            {"steps": k, "n": n, "accuracy": a} for k, n, a in ev.by_steps(any_format=True)
        ],
        "build_seconds": round(time.monotonic() - started, 1),
    }
    if isinstance(ev, CodeEvalReport):  # the code variant: calls of the task's form
        info["tool_calls"] = ev.calls
        info["tool_calls_run_share"] = ev.calls_run_share
    return info


def sweep_temporary(out: Path) -> list[Path]:
    """Remove the temporary ``.<name>.*`` directories interrupted builds of ``out`` left
    (call under the build lock of ``out``); returns them."""
    swept = [p for p in Path(out).parent.glob(f".{Path(out).name}.*") if p.is_dir()]
    for p in swept:
        shutil.rmtree(p, ignore_errors=True)
    return swept


def ensure_built(
    recipe: ModelRecipe | None = None,
    out: Path | None = None,
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> BuildResult:
    """The model directory for ``recipe``, built unless a matching build is there."""
    recipe = recipe or ModelRecipe()
    path = Path(out) if out is not None else default_model_dir(recipe)
    if not force and is_built(path, recipe):
        return _cached(path)
    with _build_lock(path):
        if not force and is_built(path, recipe):  # another process built it meanwhile
            return _cached(path)
        sweep_temporary(path)
        info = build(recipe, path, progress)
    return BuildResult(path, info["hash"], False, info)


def _cached(path: Path) -> BuildResult:
    info = json.loads((path / BUILD_INFO).read_text(encoding="utf-8"))
    return BuildResult(path, info["hash"], True, info)


@contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """An exclusive lock per output directory, so concurrent callers build it once."""
    import fcntl

    locks = cache_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    with open(locks / f"{key}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
