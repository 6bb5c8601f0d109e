"""Configuration: pydantic v2 models, one YAML file plus dotted ``key=value`` overrides.

Imports nothing heavy. Every field has bounds and a docstring; a bad value raises a
``ConfigError`` naming the field path, the value and the allowed range. Components get
their sub-config (``CutoffConfig``), never the root. Configs are frozen after parsing.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from tailcut.errors import TailcutError

LogprobDistribution = Literal["sampled", "scaled", "raw"]
"""Which distribution an engine's log-probs of the sampled tokens come from."""


class ConfigError(TailcutError, ValueError):
    """A config file, override or value that cannot be used; the message is one line naming
    the file and line (or the override) and the field. A usage error: the CLI exits 2."""

    exit_code = 2


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


DEVICES = "auto, cpu, cuda, cuda:N"
"""The device strings a config takes (what the engine and the actor resolve)."""
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def check_device(value: str) -> str:
    """``value`` if it is one of :data:`DEVICES` (checked without importing torch)."""
    if not _DEVICE.fullmatch(value):
        raise ValueError(f"unknown device {value!r} ({DEVICES})")
    return value


Device = Annotated[str, AfterValidator(check_device)]
"""A device field: auto (CUDA when there is one, else the CPU), cpu, cuda or cuda:N."""


class SimEngineConfig(_Model):
    """Simulated server. The defaults model Qwen2.5-3B in bf16 on one H100 SXM (3.35 TB/s
    HBM, of which ~3.0 TB/s is reached; 989 TFLOP/s dense bf16, ~650 reached by
    batch-1024 GEMMs), serving ~1024 sequences of ~400-token context. Model facts: 3.09 B
    parameters (6.17 GB of weights, 6.17 GFLOP per generated token); 36 layers × 2 KV heads
    × 128 dims × (K, V) × 2 bytes = 36,864 bytes of KV cache per token.

    τ(1) = weights 6.17 GB / 3.0 TB/s (2.06 ms) + per-step overhead (scheduler loop,
    graph launch, sampler: ~2 ms) ≈ 4.1 ms.
    τ(1024) = GEMMs 1024 × 6.17 GFLOP / 650 TFLOP/s (9.7 ms: compute-bound above b ≈ 210,
    the weight read hides inside) + KV 1024 × 400 × 36,864 B / 3.0 TB/s (5.0 ms) +
    sampling and per-request bookkeeping (~1 µs each: 1.0 ms) + per-step overhead (2 ms)
    ≈ 17.8 ms.
    The line through both: a = 4.0 ms, c = 13.5 µs."""

    decode_a_s: float = Field(0.004, ge=0.0, le=10.0)
    """Fixed cost of one decode step, seconds (τ(b) = a + c·b): the weight read plus the
    per-step overhead (see the class docstring)."""
    decode_c_s: float = Field(1.35e-5, ge=0.0, le=1.0)
    """Per-running-sequence cost of one decode step, seconds: its share of the GEMM FLOPs
    (above the compute-bound batch size), its KV read, sampling and bookkeeping."""
    prefill_s_per_token: float = Field(2.0e-6, ge=0.0, le=1.0)
    """Prefill cost per prompt token, seconds. A new token costs ~9.5 µs (6.17 GFLOP at
    650 TFLOP/s), but with prefix caching a later turn only prefills what the last turn
    added (the tool answer); the engine charges every prompt token of every turn, so the
    effective rate over a multi-turn trajectory is ~2 µs."""
    kv_capacity_tokens: int = Field(1_600_000, ge=1)
    """KV-cache capacity in tokens; requests queue when it is full. Default: ~59 GB of
    an 80 GB H100 at 36,864 B per token (after weights, activations and graphs)."""
    kv_block_size: int = Field(16, ge=1, le=1024)
    """Tokens per KV block (for the blocks-in-use counter)."""
    max_running: int | None = Field(None, ge=1)
    """Most sequences decoded together (vLLM's ``max_num_seqs``); None: as many as the KV
    cache holds."""
    preemption: Literal["recompute", "keep"] = "recompute"
    """When a request of better ``priority`` (lower) waits for a batch slot, the running one
    of worst priority is paused: ``recompute`` frees its KV cache and prefills its prompt
    and tokens again when it resumes (vLLM's preemption); ``keep`` keeps its KV cache
    reserved and resumes without a prefill. Only requests that carry priorities preempt."""


class HFEngineConfig(_Model):
    max_seq_len: int = Field(4096, ge=16, le=1_048_576)
    """KV-cache slot length: prompt plus generated tokens of one request (capped by the
    model's max_position_embeddings)."""
    max_prefill_tokens: int = Field(8192, ge=16, le=1_048_576)
    """Most padded prompt tokens (rows x longest prompt) prefilled in one forward pass; a
    prompt longer than this is prefilled in chunks of columns, one pass each (same tokens
    and log-probs as one pass)."""
    kv_block_size: int = Field(16, ge=1, le=1024)
    """Tokens per KV block in the blocks-in-use counter."""
    logprobs: LogprobDistribution = "sampled"
    """Which log-prob of each sampled token is returned: sampled = the temperature-scaled,
    top-p-renormalised distribution sampled from; scaled = temperature-scaled, no top-p;
    raw = the model's own distribution (temperature 1)."""
    seed: int = Field(0, ge=0)
    """Seeds the random streams of requests that carry no seed of their own."""
    cuda_graphs: bool = True
    """On CUDA, replay the decode pass from CUDA graphs (one per bucket of rows x key
    columns, captured on first use); the KV cache is then allocated at full capacity up
    front. Ignored on CPU."""
    compile_layers: bool | None = None
    """Decode passes run the text model's forward compiled as one graph (``torch.compile``:
    its norms, rotary embeddings, activations and residual adds fused, across layers too),
    attention the engine's opaque operator in it (``hf/compiled.py``); compiling takes
    seconds to a minute over the first passes. None: where decode passes replay CUDA
    graphs (on CUDA with ``cuda_graphs``)."""
    fuse_projections: bool | None = None
    """In the engine's passes, each attention layer's q/k/v projections run as one GEMM
    and each gated MLP's gate/up projections as one (their weights laid end to end, the
    parameters views of them: ``hf/fused.py``). None: where decode passes replay CUDA
    graphs."""
    overlap: bool | None = None
    """Queue each decode pass before reading the tokens of the one before (fed them on
    the device), so the host's bookkeeping of pass N runs while the device runs pass N+1;
    a row that pass N finished runs one wasted column in N+1. Tokens are the same either
    way. None: where decode passes replay CUDA graphs (0.5B bf16 at batch 64 on an H100:
    1.65 -> 1.49 ms a decode pass)."""
    decode_kernel: bool | None = None
    """Decode passes run attention as one Triton kernel over each row's own cache columns,
    storing the pass's new keys and values itself (``hf/decode_attention.py``), instead of
    an indexed store and a masked ``scaled_dot_product_attention`` over the pass's widest
    row. None: on CUDA where Triton imports (0.5B bf16 at batch 64 on an H100, with
    ``overlap``: 1.49 -> 1.39 ms a decode pass); true elsewhere is an error."""
    sample_kernel: bool | None = None
    """Passes whose rows all sample the full distribution (``top_p`` 1) draw their tokens
    with one Triton kernel reading the logits in the model's dtype (``hf/sample_kernel.py``)
    instead of the eager sampler's ~25 kernels over float32 copies; a pass with a top-p
    row runs the eager one. None: on CUDA where Triton imports (0.5B bf16 at batch 64 on an
    H100, with the decode kernel's wider tiles, the LM head writing into the graph's
    buffer and the rotary/final norm compiled: 1.332 -> 1.198 ms a decode pass); true
    where Triton cannot run is an error."""
    skinny_linear: bool | None = None
    """Decode passes of at most 64 rows run the attention's q/k/v (fused) and output
    projections with one Triton kernel each that spreads the weight's rows over many
    programs (``hf/skinny_linear.py``) instead of cuBLAS's wide tiles on a few SMs; needs
    ``fuse_projections``' groups (it installs them). None: off (0.5B bf16 at batch 64 on an
    H100: 1.15–1.20 ms a decode pass with and without; ``python -m
    tailcut.bench.linear_bench`` times it per projection); true where Triton cannot run is
    an error."""
    pdl: bool | None = None
    """Programmatic dependent launch (Hopper and later, compute capability 9+): decode
    passes launch the compiled decode forward's kernels (inductor's
    ``triton.enable_pdl``) and the decode-attention kernel so that each one's blocks are
    scheduled while the kernel before it drains, and wait on the device for its outputs
    (``griddepcontrol.wait``) before reading them: the gap between two kernels of a
    replayed pass shrinks. Tokens are the same either way. None: off (undecided: 0.5B bf16
    at batch 64 on an H100, two A/Bs in one session gave A ÷ B 1.010 and 1.116 with runs
    spread 1.01–1.32 ms a pass on both sides; ``python -m tailcut.bench.hf_ab MODEL
    --switch pdl`` measures it against the defaults); true on another device is an
    error."""
    inductor: dict[str, Any] = Field(default_factory=dict)
    """Settings of ``torch._inductor.config`` the compiled decode forward is compiled
    with (``compile_layers``), as a serving engine's inductor compile config: dotted or
    nested keys, such as ``combo_kernels: true`` or ``triton.max_tiles: 2``. They hold on
    the thread of the decode passes that compile it; inductor's compile workers in
    other processes get only part of its settings, so settings of that pool itself
    (``compile_threads``) do not take effect. Empty: inductor's own defaults, which is what
    the engine's figures were measured with; ``python -m tailcut.bench.hf_ab MODEL
    --inductor KEY=VALUE`` times one against them. A key inductor lacks or keeps private,
    ``triton.enable_pdl`` (``pdl`` sets it), a value of a type the setting does not take,
    or settings where the decode forward is not compiled are errors when the engine starts."""
    admit_min_rows: int = Field(8, ge=1, le=4096)
    """While requests decode, waiting requests are admitted once this many can be
    prefilled together (or after ``admit_max_wait`` decode passes): a prefill is a forward
    pass of its own, so fewer, larger prefills leave more time for decoding."""
    admit_max_wait: int = Field(8, ge=0, le=1000)
    """Most decode passes a waiting request waits for a batch to form (0: admit at once)."""
    vocab_rows: int | None = Field(None, ge=1)
    """Rows of the LM head that may be sampled (greedy included): the first ``vocab_rows``
    token ids; the returned log-probs are of that restricted distribution. None: the
    length of the model directory's tokenizer where it is shorter than the head (padded
    vocabularies, the ``builtin-qwen2-*`` models), else every row."""


class RemoteEngineConfig(_Model):
    """Client settings for SGLang / vLLM servers (``engine.urls``)."""

    ready_timeout_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """How long the first request waits for every server to pass its health check."""
    connect_timeout_s: float = Field(10.0, gt=0.0, le=600.0)
    """Timeout of one TCP connect to a server."""
    control_timeout_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """Timeout of one control call (weight update, cache flush, memory release)."""
    request_timeout_s: float | None = Field(None, gt=0.0)
    """Cap on one generate call (None: none; a cut is what ends stragglers)."""
    retries: int = Field(3, ge=0, le=50)
    """Retries of a call that could not connect or got HTTP 502/503/504; a generate call
    is retried only when it never reached the server."""
    balance: Literal["round-robin", "least-loaded"] = "least-loaded"
    """How a request picks a server: in turn, or the one with fewest of our requests."""
    stream: bool = False
    """SGLang: stream tokens (partial output known client-side). vLLM always streams,
    since closing its stream is how it is told to abort."""
    reabort_interval_s: float = Field(0.25, gt=0.0, le=60.0)
    """Longest wait between re-sent aborts while an abort is not yet confirmed."""
    verify_load: bool = True
    """After an abort, check the servers' load counters until they hold no more requests
    than ours still running (turn off when other clients share the servers)."""
    exclusive: bool = False
    """The servers serve tailcut alone: an abort of every request we have on a server is
    sent as one ``abort_all`` (SGLang) instead of one call per request."""
    model_name: str | None = None
    """vLLM served model name (None: the first one /v1/models lists)."""
    api_key: str | None = None
    """Bearer token sent to the servers (None: none)."""
    max_connections: int = Field(1024, ge=1, le=100_000)
    """Open connections per server (one per concurrent request)."""
    logprobs: LogprobDistribution | None = None
    """Which distribution the servers' log-probs come from, as they were started: vLLM
    ``--logprobs-mode raw_logprobs`` (its default) is raw, ``processed_logprobs`` is sampled
    (temperature and top-p applied); SGLang returns scaled (temperature applied, no top-p;
    ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``: raw). None: that engine's default."""


class EngineConfig(_Model):
    kind: Literal["sim", "hf", "sglang", "vllm"] = "sim"
    """Which engine generates: simulated, embedded HF, or a remote server."""
    model: str = "builtin"
    """Model directory, or ``builtin`` for the locally built tiny model."""
    urls: list[str] = Field(default_factory=list)
    """Server base URLs for sglang / vllm (one or many, data-parallel)."""
    device: Device = "auto"
    """Device for the embedded engine: auto, cpu, cuda, cuda:N."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype for the embedded engine (auto: bf16 on CUDA, fp32 on CPU)."""
    max_batch_size: int = Field(64, ge=1, le=4096)
    """Most sequences decoded together by the embedded engine."""
    abort_deadline_s: float = Field(5.0, gt=0.0, le=600.0)
    """How long a cut waits for aborts to be confirmed before reporting the ids."""
    sim: SimEngineConfig = SimEngineConfig()
    """Simulated engine model parameters."""
    hf: HFEngineConfig = HFEngineConfig()
    """Embedded (in-process Hugging Face) engine parameters."""
    remote: RemoteEngineConfig = RemoteEngineConfig()
    """SGLang / vLLM server client settings."""
    release_between_steps: Literal["none", "kv", "kv+weights"] = "none"
    """Colocation on one GPU: what the engine hands back while the actor trains (hf and
    sglang): none; kv, its KV cache (and the CUDA graphs that read it); kv+weights, its
    weights too (offloaded to host memory). Taken back before the next rollout
    (``tailcut.engine.base.release_for_training`` / ``resume_for_rollout``)."""

    @property
    def logprob_distribution(self) -> LogprobDistribution:
        """Which distribution this engine's log-probs of the sampled tokens come from:
        ``sampled`` (temperature-scaled, top-p-renormalised: what was sampled from),
        ``scaled`` (temperature-scaled full softmax) or ``raw`` (the model at temperature 1)."""
        if self.kind == "hf":
            return self.hf.logprobs
        if self.remote.logprobs is not None:
            return self.remote.logprobs
        return "scaled" if self.kind == "sglang" else "raw" if self.kind == "vllm" else "sampled"


OVER_PROVISION_MAX = 4.0
"""The most ``cutoff.over_provision`` asks: a step launches at most 5× what it keeps."""


class CutoffConfig(_Model):
    policy: Literal["wait-all", "target-count", "over-provision", "group-quota", "deadline"] = (
        "target-count"
    )
    """When to cut the step (see rollout/cutoff.py)."""
    abort_ratio: float = Field(0.1, ge=0.0, lt=1.0)
    """target-count: launch N, keep the first int(N·(1−r))."""
    over_provision: float = Field(0.1, ge=0.0, le=OVER_PROVISION_MAX)
    """over-provision / group-quota: launch ⌈N·(1+o)⌉ (or extra groups) to keep N."""
    deadline_s: float | None = Field(None, gt=0.0)
    """deadline: fixed deadline in seconds (None = learned)."""
    min_fraction: float = Field(0.7, ge=0.0, le=1.0)
    """deadline: never cut before this fraction of launched requests is done."""
    quantile: float = Field(0.25, gt=0.0, le=1.0)
    """deadline (learned): quantile of recent steps' completion times (the lower quartile:
    steadier than the median against long and outlier steps; see cutoff.Deadline)."""
    slack: float = Field(0.3, ge=0.0, le=10.0)
    """deadline (learned): the deadline is the quantile times (1 + slack)."""
    history: int = Field(8, ge=1, le=1000)
    """deadline (learned): how many recent steps to learn from."""
    aborted: Literal["drop", "mask", "partial"] = "drop"
    """What happens to cut-off samples in training (see algo/batch.py)."""
    max_staleness: int = Field(1, ge=0, le=100)
    """partial: drop resumed trajectories older than this many steps."""
    audit_every: int = Field(0, ge=0)
    """Every k steps run uncut to measure the reward estimators' bias (0 = never)."""
    scope: Literal["worker", "global"] = "worker"
    """With many workers: cut each worker at its own target, or all at a global one."""
    tolerate_worker_loss: bool = False
    """Record a dead worker's requests as FAILED and go on (else fail the step)."""
    long_rounds: bool = False
    """Keep the long samples (``rollout/long_rounds.py``): a group with a cut member is not
    trained in its step; it is queued (with ``partial``: a trajectory past
    ``max_staleness``) and completed in a later long round together with the other queued
    groups (the tail batched with the tail): its finished members kept, its cut members
    continued to their end, uncut — or, once older than ``max_staleness`` steps, its prompt
    run again whole."""
    long_round_prompts: int | None = Field(None, ge=1)
    """Queued prompts that start a long round (None: a step's ``data.batch_size``)."""
    adapt: bool = False
    """Pick the cut each step (target-count: ``abort_ratio``; over-provision, group-quota:
    ``over_provision``) from recent completion times, for the most kept samples per second
    under ``max_length_bias`` (``rollout/adapt.py``). Starts from the configured value."""
    adapt_min: float = Field(0.0, ge=0.0, lt=1.0)
    """adapt: smallest share of a step's launched samples the cut may abort."""
    adapt_max: float = Field(0.4, gt=0.0, lt=1.0)
    """adapt: largest share of a step's launched samples the cut may abort."""
    adapt_max_change: float = Field(0.05, gt=0.0, le=1.0)
    """adapt: most the cut share moves from one step to the next."""
    max_length_bias: float = Field(0.1, gt=0.0, le=1.0)
    """adapt: the predicted ``bias/length`` (mean length of kept samples over that of all,
    minus 1) the chosen cut may reach in magnitude."""


class ScheduleConfig(_Model):
    """Length-aware scheduling inside the over-sampled step (``rollout/spf.py``)."""

    kind: Literal["fifo", "spf"] = "fifo"
    """fifo: every engine call goes in as it comes; spf: shortest-predicted-first, the
    likely stragglers wait at their next engine call and requests carry their predicted
    remaining tokens as their priority."""
    margin: float = Field(0.05, ge=0.0, le=1.0)
    """spf: trajectories allowed in beyond those still needed, as a fraction of the
    over-sample (1: all, plain cut-off)."""
    need_ratio: float = Field(1.0, ge=0.0, le=100.0)
    """spf: ... and at least this many times those still needed (0: hold from launch,
    which pays only with a near-perfect launch-time prediction; see
    examples/length_aware)."""


class AgentLoopConfig(_Model):
    """One multi-turn trajectory: generate → parse tool calls → run tools → repeat."""

    max_turns: int = Field(8, ge=1, le=1000)
    """Most assistant turns (engine calls) per trajectory."""
    max_response_tokens: int = Field(4096, ge=1, le=1_048_576)
    """Most response tokens across turns (sampled and tool output), as in verl's response_length."""
    max_new_tokens: int = Field(1024, ge=1, le=1_048_576)
    """Most tokens sampled in one turn (also capped by what is left of max_response_tokens)."""
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    tool_parser: Literal["hermes", "llama3_json", "mistral", "auto"] = "hermes"
    """How tool calls are read from assistant text (``chat/parser.py``): hermes
    ``<tool_call>`` (Qwen), llama3_json (Llama 3.x JSON calls), mistral ``[TOOL_CALLS]``;
    auto: the format the model's chat template names, else each turn by its call markers."""
    max_tool_calls_per_turn: int = Field(8, ge=1, le=256)
    """Calls beyond this in one turn are answered with an error message, not run."""
    max_tool_call_chars: int = Field(16_384, ge=16, le=10_000_000)
    """A tool-call block longer than this is a parse error."""
    max_tool_response_chars: int = Field(8_192, ge=16, le=10_000_000)
    """Tool output longer than this is cut (its start kept) before the model reads it."""


Lines = dict[tuple[str, ...], int]
"""Each key path of a config file (``("trainer", "steps")``) → the 1-based line it is on."""


def load_config(model: type[BaseModel], path: Path | None, overrides: list[str]) -> Any:
    """Load ``path`` (YAML) into ``model``, applying dotted ``key=value`` overrides. Any
    problem is one ``ConfigError`` line naming the file and line, or the override, and the
    field."""
    raw: dict[str, Any] = {}
    lines: Lines = {}
    if path is not None:
        raw, lines = read_config_file(Path(path))
    given: dict[tuple[str, ...], str] = {}
    for item in overrides:
        given[apply_override(raw, item)] = item
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, path, model, lines, given)) from None


def read_config_file(path: Path) -> tuple[dict[str, Any], Lines]:
    """The mapping a YAML config file holds and the line of each key in it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path} does not exist; give a YAML file (see configs/)"
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            f"config file {path} is a directory; give a YAML file (see configs/)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it ({exc.strerror})") from None
    if _looks_binary(data):
        raise ConfigError(
            f"config file {path} is a binary file, not YAML text; give a YAML config file (see configs/)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); save the file as UTF-8"
        ) from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        loaded = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_error_text(path, text, exc)) from None
    finally:
        loader.dispose()
    if node is None or (loaded is None and node.value == ""):  # blank, comments, a bare ---
        raise ConfigError(
            f"config file {path} is empty (no settings in it); give a YAML config (see "
            "configs/), or leave the file out to run on the defaults"
        )
    if not isinstance(node, yaml.MappingNode) or not isinstance(loaded, dict):
        got = "null" if loaded is None else f"a {type(loaded).__name__}"
        raise ConfigError(
            f"{path}:{node.start_mark.line + 1}: the top level must be a mapping of sections "
            f"(engine:, data:, trainer: ...), not {got}"
        )
    lines: Lines = {}
    _key_lines(path, node, (), lines)
    return loaded, lines


def _looks_binary(data: bytes) -> bool:
    """NUL bytes, or mostly bytes that are neither ASCII text nor UTF-8 (an image, a pickle)."""
    head = data[:8192]
    if b"\x00" in head:
        return True
    odd = sum(1 for b in head if b >= 0x80 or (b < 0x20 and b not in b"\t\n\r\f"))
    return bool(head) and odd > len(head) * 0.3 and not _is_utf8(head)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start >= len(data) - 3  # cut inside the last character
    return True


def yaml_error_text(path: Path | str, text: str, exc: yaml.YAMLError) -> str:
    """A YAML file's parse error on one line: ``file:line:col: not valid YAML: problem``
    (``text``: the file's text, for a character YAML refuses)."""
    return f"{_yaml_where(Path(path), text, exc)}: not valid YAML: {_yaml_problem(exc)}"


def _yaml_where(path: Path, text: str, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"{path}:{mark.line + 1}:{mark.column + 1}"
    position = getattr(exc, "position", None)  # a ReaderError: a character YAML refuses
    return f"{path}:{text.count(chr(10), 0, position) + 1}" if position is not None else str(path)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        context, start, end = exc.context, exc.context_mark, exc.problem_mark
        if context and start is not None and end is not None and start.line != end.line:
            context += f" started on line {start.line + 1}"
        return ", ".join(p for p in (context, exc.problem) if p) or type(exc).__name__
    return " ".join(str(exc).split())


def _key_lines(path: Path, node: yaml.MappingNode, prefix: tuple[str, ...], out: Lines) -> None:
    """Record each key's line; a key given twice in one mapping is an error (YAML would
    silently keep the last)."""
    for key_node, value_node in node.value:
        key = (*prefix, str(key_node.value))
        line = key_node.start_mark.line + 1
        if key in out:
            raise ConfigError(
                f"{path}:{line}: {'.'.join(key)} is given twice (also on line {out[key]}); keep one"
            )
        out[key] = line
        if isinstance(value_node, yaml.MappingNode):
            _key_lines(path, value_node, key, out)


def apply_override(raw: dict[str, Any], item: str) -> tuple[str, ...]:
    """Set the dotted ``key=value`` ``item`` in ``raw`` (the value read as YAML); returns
    the key path."""
    key, sep, value = item.partition("=")
    parts = tuple(key.split("."))
    if not sep or not all(parts):
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"override {item!r}: {where} is a value, not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(value) if value else value
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"override {item!r}: {value!r} is not a YAML value ({_yaml_problem(exc)}); write "
            f"e.g. {key}=3, {key}=text, {key}=[a, b], or quote it"
        ) from None
    return parts


def format_validation_error(
    exc: ValidationError,
    path: Path | None = None,
    model: type[BaseModel] | None = None,
    lines: Lines | None = None,
    overrides: dict[tuple[str, ...], str] | None = None,
) -> str:
    """Every validation error on one line: where it comes from (``file:line`` or the
    override), the field, the message, the allowed range and the value given."""
    parts = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        named = _FIELD_IN_MESSAGE.match(msg) if not loc else None
        key = tuple(named.group(1).split(".")) if named else loc
        if err["type"] == "extra_forbidden" and loc:
            text = f"{'.'.join(loc)}: unknown key{_did_you_mean(model, err['loc'])}"
        else:
            text = msg if named else f"{'.'.join(loc) or '(root)'}: {msg}"
            allowed = allowed_range(model, err["loc"]) if model is not None and loc else None
            if allowed:
                text += f"; allowed: {allowed}"
            if loc and err["type"] not in ("missing", "value_error"):
                text += f" (got {_short(err.get('input'))})"
        parts.append(f"{_source(key, path, lines or {}, overrides or {})}{text}")
    count = f" ({len(parts)} errors)" if len(parts) > 1 else ""
    return f"invalid configuration{count}: " + "; ".join(parts)


def _did_you_mean(model: type[BaseModel] | None, loc: tuple[int | str, ...]) -> str:
    """For an unknown key at ``loc``: ``; did you mean 'abort_ratio'?`` (the closest field
    of its section), else the section's fields when they are few, else nothing."""
    section = _model_at(model, loc[:-1]) if model is not None else None
    if section is None:
        return ""
    names = list(section.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    where = ".".join(str(p) for p in loc[:-1])
    if len(names) <= 12:
        return f"; {where or 'the top level'} has: {', '.join(names)}"
    return f"; not a field of {where}" if where else ""


def _model_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The config model of the section at ``loc`` (``()``: ``model`` itself), or None."""
    node: Any = model
    for part in loc:
        fields = getattr(node, "model_fields", None)
        if not isinstance(part, str) or fields is None or part not in fields:
            return None
        node = fields[part].annotation
    return node if isinstance(node, type) and issubclass(node, BaseModel) else None


_FIELD_IN_MESSAGE = re.compile(r"^([a-z_]+(?:\.[a-z_]+)+):")


def _source(
    key: tuple[str, ...], path: Path | None, lines: Lines, overrides: dict[tuple[str, ...], str]
) -> str:
    """``override 'k=v': `` or ``file:line: `` for the nearest given ancestor of ``key``."""
    deeper = [item for given, item in overrides.items() if key and given[: len(key)] == key]
    if deeper:
        return f"override {deeper[-1]!r}: "
    for n in range(len(key), 0, -1):
        if key[:n] in overrides:
            return f"override {overrides[key[:n]]!r}: "
        if key[:n] in lines:
            return f"{path}:{lines[key[:n]]}: "
    return f"{path}: " if path is not None else ""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def allowed_range(model: type[BaseModel], loc: tuple[int | str, ...]) -> str | None:
    """The bounds of the field at ``loc`` as text (``0 <= x < 1``), or None if unbounded."""
    field_info = None
    node: Any = model
    for part in loc:
        fields = getattr(node, "model_fields", None)
        if not isinstance(part, str) or fields is None or part not in fields:
            return None
        field_info = fields[part]
        node = field_info.annotation
    if field_info is None:
        return None
    low = high = ""
    for meta in field_info.metadata:
        for attr, text in (("ge", "{} <= "), ("gt", "{} < ")):
            if getattr(meta, attr, None) is not None:
                low = text.format(getattr(meta, attr))
        for attr, text in (("le", " <= {}"), ("lt", " < {}")):
            if getattr(meta, attr, None) is not None:
                high = text.format(getattr(meta, attr))
    return f"{low}x{high}" if low or high else None


def dump_config(cfg: BaseModel, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
