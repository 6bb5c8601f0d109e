"""The root configuration of ``tailcut train``: one YAML file plus dotted overrides.

Sections: ``engine`` / ``cutoff`` / ``agent`` (shared with the rollout tools), ``data``,
``algo``, ``actor``, ``trainer``. Every field has bounds; a bad value raises ``ConfigError``
naming the field path, the value and the allowed range. Imports nothing heavy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tailcut.config import (
    OVER_PROVISION_MAX,
    AgentLoopConfig,
    CutoffConfig,
    Device,
    EngineConfig,
    ScheduleConfig,
    load_config,
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class DataConfig(_Model):
    task: Literal["arith", "parquet"] = "arith"
    """arith: the built-in synthetic task (generated, seeded); parquet: verl-format files."""
    train_path: str | None = None
    """Training prompts (verl-format parquet) for task=parquet."""
    val_path: str | None = None
    """Validation prompts (verl-format parquet) for task=parquet."""
    batch_size: int = Field(8, ge=1, le=65_536)
    """Prompts per step; each is sampled ``algo.group_size`` times."""
    val_size: int = Field(64, ge=0, le=1_000_000)
    """Validation prompts (the first ones of the validation set; 0 = no validation)."""
    train_size: int = Field(20_000, ge=1, le=100_000_000)
    """arith: training problems generated (cycled through, reshuffled each epoch)."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Skip prompts longer than this (parquet; None = keep all)."""
    shuffle: bool = True
    """Shuffle the training prompts (seeded by ``trainer.seed``), again each epoch."""
    arith_max_steps: int = Field(10, ge=1, le=64)
    """arith: most calculator steps of a problem."""
    arith_tail_alpha: float = Field(1.1, ge=0.0, le=10.0)
    """arith: P(k steps) ∝ k**-alpha (the long tail a step cuts)."""
    val_seed: int = Field(1_000_003, ge=0)
    """arith: seed of the validation problems (disjoint from training)."""
    tools: list[Literal["calculator", "calc_gsm8k_reward", "code_interpreter"]] = ["calculator"]
    """Built-in tools the agent may call (ignored when ``tool_config`` is set);
    code_interpreter runs in the local sandbox (Sandbox Fusion: a ``tool_config``)."""
    tool_config: str | None = None
    """A verl tool-config YAML file (``tools: [{class_name, config, tool_schema}]``)."""
    reward: Literal["answer", "tool"] = "answer"
    """answer: the reward function of each row's ``data_source`` (``tailcut/arith``: the
    integer after ``####``; ``openai/gsm8k``: verl's strict GSM8K; MATH sets: math-verify;
    ``math_dapo``/``aime*``: DAPO) against ``reward_model.ground_truth``;
    tool: the sum of the tools' rewards (e.g. calc_gsm8k_reward)."""
    reward_fn: Literal["arith", "gsm8k", "gsm8k_flexible", "math", "dapo"] | None = None
    """reward=answer: this registry function for every row, whatever its data_source
    (None: resolved by data_source; an unknown data_source fails the sample, naming it)."""
    overlong_buffer: int = Field(0, ge=0, le=1_048_576)
    """DAPO's overlong penalty: a response longer than ``agent.max_response_tokens`` minus
    this many tokens loses ``overlong_penalty`` × (tokens past that) / buffer, at most
    ``overlong_penalty`` (``reward/overlong.py``; 0 = off)."""
    overlong_penalty: float = Field(1.0, ge=0.0, le=100.0)
    """Largest overlong penalty (reached at ``agent.max_response_tokens``)."""


class AlgoConfig(_Model):
    group_size: int = Field(4, ge=1, le=1024)
    """Samples per prompt (the GRPO group)."""
    estimator: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """Advantage estimator (algo/advantage.py)."""
    small_group: Literal["zero", "drop"] = "zero"
    """A group left with fewer than 2 members: advantage 0, or its rows dropped."""
    adv_eps: float = Field(1e-6, gt=0.0, le=1.0)
    """GRPO: added to the group std."""
    loss_agg: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """Loss aggregation mode (formulas in algo/loss.py)."""
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """PPO clip: ratio floor 1 − clip_low."""
    clip_high: float = Field(0.2, ge=0.0, le=10.0)
    """PPO clip: ratio ceiling 1 + clip_high (> clip_low: clip-higher)."""
    kl_coef: float = Field(0.0, ge=0.0, le=100.0)
    """Weight of the KL to the initial (reference) policy; 0 loads no reference model."""
    kl_type: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (algo/loss.py)."""
    norm_len: int | None = Field(None, ge=1)
    """seq-mean-token-sum-norm: the constant L (None = agent.max_response_tokens)."""
    clip_ratio_c: float | None = Field(3.0, gt=1.0, le=1000.0)
    """Dual-clip: for tokens with A < 0 the loss is capped at |A|·c, so a stale or
    mismatched token with a huge ratio cannot dominate (verl's ``clip_ratio_c``; None: off)."""
    old_logprobs: Literal["recompute", "engine"] = "recompute"
    """Where π_old of the PPO ratio comes from. recompute: the actor scores the batch before
    its update (the on-policy ratio is 1 whatever the sampler; the engine's log-probs feed
    only ``rollout_correction``); engine: the log-probs the engine returned (refused when
    they cannot equal the actor's distribution, e.g. top_p < 1 with sampled log-probs)."""
    rollout_correction: Literal["none", "token-tis", "seq-tis", "token-mis", "seq-mis"] = "none"
    """Correction for the engine/trainer mismatch w = π_old/μ (recompute only): tis
    multiplies each token's loss by min(w, C) (seq: w of the whole sequence); mis removes
    tokens (seq: whole sequences) with w outside [1/C, C] from the loss and its denominators.
    Unless given, token-tis with ``cutoff.aborted=partial`` or ``cutoff.long_rounds`` (their
    tokens of an older policy are weighed by it alone), else none."""
    rollout_correction_threshold: float = Field(2.0, gt=1.0, le=1e6)
    """C of ``rollout_correction``."""
    filter_groups: Literal["none", "zero-std"] = "none"
    """Dynamic sampling (DAPO, verl's ``filter_groups``): zero-std drops the groups whose
    rewards are all equal (no learning signal) and launches more groups, in up to
    ``max_gen_rounds`` extra rounds, until the batch holds ``data.batch_size`` informative
    groups (``algo/filter.py``)."""
    max_gen_rounds: int = Field(3, ge=0, le=100)
    """filter_groups: extra launch rounds a step may take to fill its batch (0: none; the
    batch is then whatever the first round left)."""
    filter_first_round: Literal["batch", "learned"] = "learned"
    """filter_groups: the groups a step's first round launches. batch: ``data.batch_size``,
    the extra rounds fill the rest; learned: ``data.batch_size`` over the lowest informative
    share of the last 4 steps (at most ``(1 + max_gen_rounds) × data.batch_size``), so that
    one round usually fills the batch (verl's ``data.gen_batch_size``, learned)."""


class ActorConfig(_Model):
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up, in optimizer steps."""
    grad_clip: float = Field(1.0, ge=0.0, le=1e6)
    """Clip the gradient norm to this (0 = no clipping)."""
    mini_batches: int = Field(1, ge=1, le=1024)
    """Optimizer steps per rollout step (the batch split in this many mini-batches)."""
    epochs: int = Field(1, ge=1, le=64)
    """Passes over the batch per rollout step."""
    micro_batch_rows: int = Field(16, ge=1, le=65_536)
    """Rows per forward/backward (gradient accumulation inside a mini-batch)."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1, le=1 << 30)
    """Pack micro-batches by tokens instead of rows: rows sorted by length, as many per
    micro-batch as keep rows × padded width (longest prompt + longest response) within this;
    a row longer than it goes alone. None: ``micro_batch_rows`` rows each."""
    logprob_chunk_tokens: int | None = Field(1024, ge=1, le=1 << 30)
    """Token positions per chunk of the LM head and log-softmax (recomputed in the backward),
    so a micro-batch's full fp32 logits never exist at once. None: one piece."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward (less memory, ~1/3 more
    compute)."""
    offload: bool = False
    """Sharded runs on CUDA: keep the parameter, gradient and optimizer shards on the CPU
    (FSDP2 ``CPUOffloadPolicy``; the optimizer step runs there)."""
    device: Device = "auto"
    """auto (CUDA when there is one, else the CPU), cpu, cuda, cuda:N."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype (auto: bf16 autocast on CUDA, fp32 on CPU); weights stay fp32."""
    threads: int | None = Field(None, ge=1, le=1024)
    """torch intra-op threads on CPU (None: torch's default)."""


class RolloutConfig(_Model):
    workers: int = Field(1, ge=1, le=4096)
    """Rollout workers; a step's samples are split over them in contiguous blocks of
    whole groups. One cut-off policy decides for the whole step (``cutoff.scope`` must be
    global, the default once workers > 1), so the cut and the batch mean what they mean
    with one worker."""
    backend: Literal["local", "ray"] = "local"
    """local: workers on the trainer's event loop, sharing its engine; ray: one Ray actor
    per worker, built from the setup's picklable worker recipe (needs ``ray.init``)."""
    num_cpus_per_worker: float = Field(0.5, gt=0.0, le=1024.0)
    """ray: CPUs each worker actor reserves."""
    gc_pause: bool = True
    """Pause Python's cyclic garbage collector while a rollout step runs and collect the
    young generations once at its end (a step allocates many short-lived objects; a
    collection mid-step stalls every trajectory). False: the interpreter's default."""
    max_retries: int = Field(1, ge=0, le=100)
    """Group refill: a sample whose rollout FAILED (tool crash, engine error) is relaunched
    within its step up to this many times, so its group keeps its size
    (``rollout/refill.py``; 0: never). Failures are counted before refill for
    ``trainer.max_failed_fraction``."""
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    """Length-aware scheduling inside the step (``rollout/spf.py``): ``schedule.kind=spf``
    holds the likely stragglers' next engine calls until the cut needs them and sends each
    request with its predicted remaining tokens as its priority; each worker's predictor
    learns from its earlier steps. fifo (default): every call goes in as it comes."""


class TrainerConfig(_Model):
    steps: int = Field(40, ge=1, le=10_000_000)
    """Rollout + update steps."""
    max_train_s: float | None = Field(None, gt=0.0)
    """Stop once this many seconds went into steps (rollout, update, weight sync; not
    validation), for equal-budget comparisons; None = run all ``steps``."""
    seed: int = Field(0, ge=0)
    """Seeds data order, torch and sampling."""
    val_every: int = Field(5, ge=0)
    """Validate every k steps (and at the start and the end); 0 = only at start and end."""
    val_temperature: float = Field(0.0, ge=0.0, le=10.0)
    """Sampling temperature of validation (0 = greedy). Validation is never cut."""
    save_every: int = Field(10, ge=0)
    """Checkpoint every k steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = Field(2, ge=1, le=1000)
    """Most recent checkpoints kept."""
    checkpoint_format: Literal["full", "sharded"] = "full"
    """full: rank 0 gathers the actor's whole state into one ``actor.pt``; sharded:
    ``torch.distributed.checkpoint``, every rank writing its own shards (no gather; the
    checkpoint directory must be shared by all ranks). Either resumes on any number of ranks,
    and a run may resume from either form."""
    run_dir: str = "runs/tailcut"
    """Where the resolved config, metrics, traces, checkpoints and plots go: a directory of
    its own (not the current one, nor one holding other files; ``train/run_dir.py``). It
    remembers its experiment (``run.json``): reusing it with a config that changes what is
    trained is refused unless ``resume=force``."""
    resume: str = "auto"
    """auto: continue from the run directory's newest intact checkpoint if any; never: start
    fresh (refused when the run directory holds checkpoints); force: as auto, also when the
    run directory was made by a different experiment config; or a checkpoint directory (a
    directory named ``force``: ``./force``)."""
    loggers: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = ["console", "jsonl"]
    """Metric sinks (jsonl is always on; wandb needs the package and WANDB_* settings)."""
    wandb_project: str = "tailcut"
    trace: bool = True
    """Write per-step rollout traces (RUN_DIR/traces/step_k/worker_0.jsonl)."""
    sample_log: bool = False
    """Write RUN_DIR/samples.jsonl: per step, the prompts drawn and each trained sample's
    (prompt key, response tokens, reward), to compare runs prompt by prompt
    (``train/sample_log.py``)."""
    step_timeout_s: float | None = Field(None, gt=0.0)
    """Hard cap on one rollout step (cut whatever the policy says)."""
    max_failed_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """A step in which more than this share of the ended samples FAILED (engine errors,
    prompts that do not fit, unknown data sources) stops the run with the grouped reasons
    (1.0: never). Cut, filtered and zero-variance samples are not failures."""
    nproc_per_node: int = Field(1, ge=1, le=1024)
    """Ranks on this machine: ``tailcut train`` starts them with torchrun (one per GPU on
    CUDA, N processes on CPU); under ``torchrun`` itself the job's ranks come from its
    environment. Each rank has its own embedded engine and a shard of the actor."""
    dist_timeout_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """How long a rank waits in a collective (joining, a step's merge, a gradient) before
    the job stops naming the rank: a dead or hung rank cannot hang the others."""

    @model_validator(mode="after")
    def _resume_value(self) -> TrainerConfig:
        if self.resume not in ("auto", "never", "force") and not self.resume.strip():
            raise ValueError("resume must be 'auto', 'never', 'force' or a checkpoint directory")
        return self

    @field_validator("run_dir")
    @classmethod
    def _run_dir_given(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("empty; give a directory for the run, e.g. trainer.run_dir=runs/NAME")
        return value


class SyncConfig(_Model):
    """How the policy reaches the engine after each update (``train/weight_sync.py``).
    The embedded engine takes the tensors in place; SGLang / vLLM servers load a saved
    Hugging Face directory."""

    dir: str | None = None
    """Where the policy is saved for the servers to load: they read it at this same path
    (on other hosts: a shared filesystem). None: RUN_DIR/weights."""
    keep: int = Field(2, ge=1, le=1000)
    """Saved versions kept on disk (the one the servers hold is never removed)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the saved weights (auto: as the actor holds them); bfloat16 halves what is
    written and read."""
    at_start: bool = True
    """Load the actor's weights into the servers before the first rollout. Off: trust that
    the servers of a fresh run serve engine.model unchanged (a resumed run always loads)."""
    abort_in_flight: bool = True
    """Abort our requests still running (cut stragglers not yet confirmed stopped) before
    loading; off: the servers let them finish under the old weights first."""
    method: Literal["disk", "distributed"] = "disk"
    """SGLang / vLLM servers: disk (a saved directory, loaded by every server) or
    distributed (SGLang only: the tensors broadcast into the servers' memory over a
    process group they join, no disk; ``engine/update_group.py``)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """distributed: the group's backend (auto: nccl when the actor is on CUDA, else gloo)."""
    master_address: str | None = None
    """distributed: this host's address as the servers reach it (None: the one on the route
    to the first server)."""
    master_port: int = Field(0, ge=0, le=65535)
    """distributed: the port this rank hosts the group's rendezvous on (0: a free one; rank r
    of several uses master_port + r)."""
    bucket_mb: float = Field(512.0, gt=0.0, le=65536.0)
    """distributed: tensors are broadcast in buckets of about this many MiB (one server call
    each; a bucket is held in memory while it is sent)."""
    timeout_s: float = Field(300.0, gt=0.0, le=86_400.0)
    """distributed: bound on forming the group and on each bucket's broadcast."""


class TrainConfig(_Model):
    engine: EngineConfig = EngineConfig(kind="hf")
    """The inference engine the rollouts run on."""
    cutoff: CutoffConfig = CutoffConfig()
    """When a step is cut and what happens to cut-off samples."""
    agent: AgentLoopConfig = AgentLoopConfig()
    """The multi-turn agent loop (lengths, sampling, tool parsing)."""
    data: DataConfig = DataConfig()
    algo: AlgoConfig = AlgoConfig()
    actor: ActorConfig = ActorConfig()
    trainer: TrainerConfig = TrainerConfig()
    sync: SyncConfig = SyncConfig()
    """Weight sync to the engine after each update."""
    rollout: RolloutConfig = RolloutConfig()
    """Rollout workers (how many, local or on Ray)."""

    @model_validator(mode="before")
    @classmethod
    def _hf_engine_by_default(cls, data: Any) -> Any:
        """An ``engine`` section (or override) that names no ``kind`` is the embedded engine,
        as no section is (``engine.device=cpu`` alone does not turn it into ``sim``)."""
        if isinstance(data, dict) and isinstance(data.get("engine"), dict):
            data = {**data, "engine": {"kind": "hf", **data["engine"]}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _global_cut_with_workers(cls, data: Any) -> Any:
        """With several rollout workers, ``cutoff.scope`` defaults to global."""
        if not isinstance(data, dict):
            return data
        rollout, cutoff = data.get("rollout"), data.get("cutoff")
        workers = rollout.get("workers", 1) if isinstance(rollout, dict) else 1
        if isinstance(workers, int) and workers > 1 and isinstance(cutoff, dict | None):
            data = {**data, "cutoff": {"scope": "global", **(cutoff or {})}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _stale_tokens_corrected(cls, data: Any) -> Any:
        """Resumed trajectories (``cutoff.aborted=partial``) and long rounds train tokens an
        older policy sampled; π_old is the current actor's, so the PPO ratio is 1 on them
        and only ``algo.rollout_correction`` weighs them by π_old/μ: unless it is given, it
        is token-tis there (with ``old_logprobs=engine`` there is nothing to correct)."""
        if not isinstance(data, dict):
            return data
        cutoff, algo = data.get("cutoff"), data.get("algo")
        if not isinstance(cutoff, dict) or not isinstance(algo, dict | None):
            return data
        stale = cutoff.get("aborted") == "partial" or cutoff.get("long_rounds") is True
        algo = algo or {}
        if stale and "rollout_correction" not in algo and algo.get("old_logprobs") != "engine":
            data = {**data, "algo": {**algo, "rollout_correction": "token-tis"}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.cutoff.policy == "group-quota" and self.cutoff.aborted == "partial":
            raise ValueError(
                "cutoff.aborted: 'partial' does not combine with cutoff.policy=group-quota "
                "(it keeps whole groups only); use drop or mask"
            )
        if self.engine.kind == "sim":
            raise ValueError(
                "engine.kind: 'sim' generates no tokens to train on; use hf, sglang or vllm"
            )
        if self.engine.kind in ("sglang", "vllm") and not self.engine.urls:
            raise ValueError(f"engine.urls: engine.kind={self.engine.kind} needs server URLs")
        if self.sync.method == "distributed" and self.engine.kind != "sglang":
            raise ValueError(
                f"sync.method: 'distributed' broadcasts into SGLang servers; engine.kind="
                f"{self.engine.kind} syncs "
                + ("in process already" if self.engine.kind == "hf" else "through disk only "
                   "(vLLM's in-memory path needs its NCCL weight-transfer engine; "
                   "docs/training.md)")
                + ", so use sync.method=disk"
            )  # fmt: skip
        if self.rollout.workers > 1 and self.cutoff.scope == "worker":
            raise ValueError(
                "cutoff.scope: 'worker' gives each rollout worker its own target; training "
                "cuts a step with one policy over all workers, so use cutoff.scope=global"
            )
        n = self.trainer.nproc_per_node
        if n > 1 and (self.rollout.workers > 1 or self.rollout.backend != "local"):
            raise ValueError(
                "trainer.nproc_per_node: with several ranks each rank runs one rollout worker "
                "(on its embedded engine or its share of engine.urls); use rollout.workers=1, "
                "rollout.backend=local"
            )
        if n > 1 and self.engine.kind in ("sglang", "vllm") and len(self.engine.urls) < n:
            raise ValueError(
                f"engine.urls: {len(self.engine.urls)} server(s) for {n} ranks; each rank "
                "drives its own share of the servers, so give at least one URL per rank"
            )
        if self.rollout.workers > self.data.batch_size:
            raise ValueError(
                f"rollout.workers: {self.rollout.workers} workers for data.batch_size="
                f"{self.data.batch_size} prompts (each worker needs a whole group at least)"
            )
        self._check_logprobs()
        self._check_budget()
        if self.data.overlong_buffer >= self.agent.max_response_tokens:
            raise ValueError(
                f"data.overlong_buffer: {self.data.overlong_buffer} tokens leave no length "
                f"unpenalized under agent.max_response_tokens={self.agent.max_response_tokens}"
            )
        if self.data.task == "parquet" and not self.data.train_path:
            raise ValueError("data.train_path: data.task=parquet needs a training file")
        return self

    def _check_budget(self) -> None:
        """The adaptive cut adapts a share a policy has, from a start within its bounds."""
        c = self.cutoff
        if not c.adapt:
            return
        if c.policy not in ("target-count", "over-provision", "group-quota"):
            raise ValueError(
                f"cutoff.adapt: adapts the cut of target-count, over-provision or group-quota, "
                f"not cutoff.policy={c.policy}"
            )
        if c.policy == "group-quota" and self.algo.filter_groups != "none":
            raise ValueError(
                "cutoff.adapt: under algo.filter_groups, group-quota cuts at the batch's "
                "informative groups, not at a share the adaptive cut can model; set "
                "cutoff.adapt=false or algo.filter_groups=none"
            )
        if c.adapt_min >= c.adapt_max:
            raise ValueError(
                f"cutoff.adapt_min: {c.adapt_min} must be below cutoff.adapt_max={c.adapt_max}"
            )
        most = OVER_PROVISION_MAX / (1.0 + OVER_PROVISION_MAX)
        if c.policy != "target-count" and c.adapt_max > most + 1e-12:
            raise ValueError(
                f"cutoff.adapt_max: {c.adapt_max} would let {c.policy} launch "
                f"{1.0 / (1.0 - c.adapt_max):.3g}× what it keeps; it launches at most "
                f"{1.0 + OVER_PROVISION_MAX:g}× (cutoff.over_provision ≤ {OVER_PROVISION_MAX:g}), "
                f"so cutoff.adapt_max ≤ {most:g}"
            )
        name, start = (
            ("abort_ratio", c.abort_ratio)
            if c.policy == "target-count"
            else ("over_provision", c.over_provision / (1 + c.over_provision))
        )
        if not c.adapt_min <= start <= c.adapt_max:
            raise ValueError(
                f"cutoff.{name}: the adaptive cut starts from it (a cut share of {start:.3g}), "
                f"outside [cutoff.adapt_min={c.adapt_min}, cutoff.adapt_max={c.adapt_max}]"
            )

    def _check_logprobs(self) -> None:
        """π_old from the engine must be the actor's distribution (log_softmax(logits / T))."""
        a, ag = self.algo, self.agent
        dist = self.engine.logprob_distribution
        field = "engine.hf.logprobs" if self.engine.kind == "hf" else "engine.remote.logprobs"
        if a.old_logprobs == "recompute":
            off = None
            if dist == "raw" and ag.temperature != 1:
                off = (
                    f"{field}=raw gives temperature-1 log-probs, sampled at "
                    f"agent.temperature={ag.temperature}"
                )
            elif dist == "scaled" and ag.top_p < 1:
                off = f"{field}=scaled leaves out the nucleus agent.top_p={ag.top_p} sampled from"
            if a.rollout_correction != "none" and off is not None:
                hint = (
                    " (vLLM: --logprobs-mode processed_logprobs)"
                    if self.engine.kind == "vllm"
                    else ""
                )
                raise ValueError(
                    f"algo.rollout_correction: {a.rollout_correction!r} (the default with "
                    "cutoff.aborted=partial or cutoff.long_rounds) weighs each token by "
                    f"π_old/μ, μ the distribution the engine sampled from; {off}: use "
                    f"{field}=sampled{hint} where the engine gives it, or "
                    "algo.rollout_correction=none"
                )
            return
        if a.rollout_correction != "none":
            raise ValueError(
                f"algo.rollout_correction: {a.rollout_correction!r} needs "
                "algo.old_logprobs=recompute (with engine log-probs as π_old its weight is 1)"
            )
        why = None
        if ag.temperature == 0:
            why = "agent.temperature=0 samples greedily (the engine reports a point mass)"
        elif dist == "sampled" and ag.top_p < 1:
            why = (
                f"{field}=sampled with agent.top_p={ag.top_p} gives log-probs inside the "
                "nucleus, the actor scores the full softmax"
            )
        elif dist == "raw" and ag.temperature != 1:
            why = (
                f"{field}=raw gives temperature-1 log-probs, the actor scores "
                f"agent.temperature={ag.temperature}"
            )
        if why is not None:
            fix = "scaled" if self.engine.kind == "hf" else "a matching server mode"
            raise ValueError(
                f"algo.old_logprobs: 'engine' cannot give the actor's π_old: {why}; use "
                f"algo.old_logprobs=recompute, or {field}={fix}"
            )

    @property
    def n_target(self) -> int:
        """Samples a step wants: prompts × group size."""
        return self.data.batch_size * self.algo.group_size


def load_train_config(path: Path | None, overrides: list[str]) -> TrainConfig:
    """Load and validate; raises ``tailcut.config.ConfigError`` naming the bad field."""
    cfg: TrainConfig = load_config(TrainConfig, path, overrides)
    return cfg
