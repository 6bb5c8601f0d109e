"""A code-variant recipe that builds in seconds (the real one takes minutes): the real
build pipeline (tokenizer, SFT on code_interpreter conversations, greedy evaluation) on the
tiny built-in recipe's one-layer model, for tests that need a real HF model directory of the
code variant, not a useful one."""

from fakes.tiny_model import TINY

TINY_CODE = TINY.model_copy(update={"variant": "code", "max_steps": 2, "strict_items": 2})
