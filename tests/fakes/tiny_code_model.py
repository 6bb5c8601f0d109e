"""A code-variant recipe that builds in seconds (the real one takes minutes): the real
build pipeline (tokenizer, SFT on code_interpreter conversations, greedy evaluation) on a
one-layer model trained for a few steps, for tests that need a real HF model directory of
the code variant, not a useful one."""

from tailcut.models import build

TINY_CODE = build.ModelRecipe(
    variant="code",
    max_steps=2,
    strict_items=2,
    tokenizer_problems=60,
    hidden_size=64,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    train_problems=16,
    steps=3,
    batch_size=4,
    warmup_steps=1,
    eval_problems=4,
)
