"""A built-in-model recipe that builds in seconds (the real one takes minutes): the real
build pipeline on a one-layer model trained for three steps, for tests that need a real
HF model directory, not a useful one."""

from tailcut.models import build

TINY = build.ModelRecipe(
    max_steps=3,
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
