"""The exact learning signal: π_old recomputed by the actor, rollout correction (TIS / MIS and
their denominators), dual-clip, no optimizer step without loss tokens, engine log-probs that
cannot be the actor's refused, missing log-probs never zeros, failures grouped by cause."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from fakes.tiny_policy import tiny_policy
from tailcut.algo.batch import TrainBatch, assemble, plan_rows
from tailcut.algo.correction import rollout_correction
from tailcut.algo.loss import LossNorm, PolicyLossSpec, ppo_clip_loss
from tailcut.algo.metrics import failure_summary
from tailcut.config import ConfigError
from tailcut.train.actor import Actor
from tailcut.train.config import ActorConfig, AlgoConfig, load_train_config
from tailcut.types import FinishReason, Sample, Status

VOCAB = 50


def batch(n: int = 6, engine_lp: float | list[list[float]] = -1.0, seed: int = 0) -> TrainBatch:
    """``n`` finished samples (two groups) with sampled and forced tokens, rewards 0/1."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        r = 4 + i % 3
        ids = torch.randint(1, VOCAB, (r,), generator=g).tolist()
        mask = [1, 1, 0] + [1] * (r - 3)
        lps = engine_lp[i][:r] if isinstance(engine_lp, list) else [engine_lp] * r
        samples.append(
            Sample(
                index=i, group=i % 2, prompt_ids=torch.randint(1, VOCAB, (3 + i % 2,), generator=g).tolist(),
                status=Status.COMPLETED, finish_reason=FinishReason.STOP, response_ids=ids,
                loss_mask=mask, logprobs=[x if m else 0.0 for x, m in zip(lps, mask, strict=True)],
                versions=[0] * r, reward=float(i % 3 == 0),
            )
        )  # fmt: skip
    plan = plan_rows(samples, None, "drop")
    adv = [1.0 if s.reward else -0.5 for s in samples]
    return assemble(plan, adv, pad_id=0)


def actor(algo: AlgoConfig | None = None, **actor_kw: Any) -> Actor:
    cfg = ActorConfig(lr=1e-2, micro_batch_rows=4, **actor_kw)
    return Actor(tiny_policy(VOCAB), cfg, algo or AlgoConfig(), norm_len=16, temperature=0.7)


def params(a: Actor) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in a.model.state_dict().items()}


# -- π_old -------------------------------------------------------------------------------


def test_recompute_makes_the_on_policy_ratio_exactly_one_whatever_the_engine_said() -> None:
    a = actor(AlgoConfig(old_logprobs="recompute"))
    out = a.update(batch(engine_lp=-3.0))  # the engine's numbers are far from the actor's
    assert out["train/ratio"] == 1.0
    assert out["train/clip_frac"] == 0.0
    assert out["train/mismatch_kl"] > 0.1  # the gap is measured, not trained on


@pytest.mark.parametrize(("mini_batches", "epochs"), [(1, 1), (1, 2), (2, 1), (3, 2)])
def test_recompute_with_a_matched_engine_gives_the_engine_modes_update(
    mini_batches: int, epochs: int
) -> None:
    b = batch()
    b.engine_logprobs[:] = actor().logprobs(b).numpy()  # the actor's own π_old
    kw = {"mini_batches": mini_batches, "epochs": epochs}
    ref = actor(AlgoConfig(old_logprobs="recompute"), **kw)
    eng = actor(AlgoConfig(old_logprobs="engine"), **kw)
    m_ref, m_eng = ref.update(copy.deepcopy(b)), eng.update(copy.deepcopy(b))
    assert m_ref["train/loss"] == m_eng["train/loss"]
    for name, p in params(ref).items():
        assert torch.equal(p, params(eng)[name]), name


def test_engine_mode_refuses_a_batch_with_missing_engine_logprobs() -> None:
    b = batch(engine_lp=math.nan)
    with pytest.raises(ValueError, match="without an engine log-prob"):
        actor(AlgoConfig(old_logprobs="engine")).update(b)
    out = actor(AlgoConfig(old_logprobs="recompute")).update(batch(engine_lp=math.nan))
    assert math.isfinite(out["train/loss"]) and out["train/ratio"] == 1.0
    assert "train/mismatch_kl" not in out  # nothing known to compare with


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["agent.top_p=0.9"], "engine.hf.logprobs=sampled with agent.top_p=0.9"),
        (["engine.hf.logprobs=raw", "agent.temperature=0.7"], "engine.hf.logprobs=raw"),
        (["agent.temperature=0"], "agent.temperature=0"),
        (
            ["engine.kind=vllm", "engine.urls=[http://127.0.0.1:1]", "agent.temperature=0.7"],
            "engine.remote.logprobs=raw",
        ),
        (["algo.rollout_correction=token-tis"], "algo.rollout_correction"),
    ],
)
def test_engine_logprobs_that_cannot_be_the_actors_are_refused(
    overrides: list[str], names: str
) -> None:
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        load_train_config(None, ["engine.kind=hf", "algo.old_logprobs=engine", *overrides])


@pytest.mark.parametrize(
    "overrides",
    [
        ["engine.hf.logprobs=scaled", "agent.top_p=0.9", "agent.temperature=0.7"],
        ["engine.hf.logprobs=sampled", "agent.temperature=0.7"],
        ["engine.hf.logprobs=raw"],
        ["engine.kind=sglang", "engine.urls=[http://127.0.0.1:1]", "agent.top_p=0.9"],
        [
            "engine.kind=vllm", "engine.urls=[http://127.0.0.1:1]",
            "engine.remote.logprobs=sampled", "agent.temperature=0.7",
        ],
    ],
)  # fmt: skip
def test_engine_logprobs_of_the_actors_distribution_are_accepted(overrides: list[str]) -> None:
    cfg = load_train_config(None, ["engine.kind=hf", "algo.old_logprobs=engine", *overrides])
    assert cfg.algo.old_logprobs == "engine"


VLLM = ["engine.kind=vllm", "engine.urls=[http://127.0.0.1:1]"]


@pytest.mark.parametrize(
    "overrides",
    [
        [*VLLM, "cutoff.aborted=partial", "agent.temperature=0.7"],  # the default correction
        [*VLLM, "cutoff.long_rounds=true", "agent.temperature=0.7"],
        ["engine.hf.logprobs=raw", "agent.temperature=0.7", "algo.rollout_correction=seq-tis"],
    ],
)
def test_a_rollout_correction_against_temperature_1_logprobs_is_refused(
    overrides: list[str],
) -> None:
    """The correction's μ must be what the engine sampled from: temperature-1 log-probs of
    tokens drawn at 0.7 weigh identical policies by up to 30× (and mask 13% under mis)."""
    with pytest.raises(ConfigError, match=r"algo\.rollout_correction: .*=raw gives temperature-1"):
        load_train_config(None, ["engine.kind=hf", *overrides])


SGLANG = ["engine.kind=sglang", "engine.urls=[http://127.0.0.1:1]", "cutoff.aborted=partial"]


def test_a_rollout_correction_against_logprobs_without_the_nucleus_is_refused() -> None:
    """SGLang's log-probs are scaled by the temperature but not cut to the top-p nucleus the
    token was drawn from: μ would be too small by the nucleus' mass on every token."""
    with pytest.raises(ConfigError, match=r"=scaled leaves out the nucleus agent\.top_p=0\.9"):
        load_train_config(None, [*SGLANG, "agent.top_p=0.9"])
    for fine in (["agent.top_p=1.0"], ["agent.top_p=0.9", "algo.rollout_correction=none"]):
        assert load_train_config(None, [*SGLANG, *fine]).cutoff.aborted == "partial"


@pytest.mark.parametrize(
    "overrides",
    [
        [*VLLM, "cutoff.aborted=partial", "agent.temperature=0.7", "engine.remote.logprobs=sampled"],
        [*VLLM, "cutoff.aborted=partial", "agent.temperature=0.7", "algo.rollout_correction=none"],
        [*VLLM, "cutoff.aborted=partial"],  # temperature 1: raw is what it sampled from
    ],
)  # fmt: skip
def test_a_rollout_correction_on_the_sampling_distribution_is_accepted(
    overrides: list[str],
) -> None:
    assert load_train_config(None, ["engine.kind=hf", *overrides]).algo.old_logprobs == "recompute"


def test_recompute_is_the_default_and_takes_any_sampler() -> None:
    cfg = load_train_config(None, ["agent.top_p=0.5", "agent.temperature=0.3"])
    assert cfg.algo.old_logprobs == "recompute" and cfg.algo.clip_ratio_c == 3.0


# -- rollout correction ------------------------------------------------------------------


def _lp(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_token_tis_truncates_the_weight_and_reports_the_mismatch() -> None:
    old = _lp([0.0, 0.0, 0.0])
    mu = _lp([0.0, -math.log(4.0), math.log(2.0)])  # w = 1, 4, 0.5
    c = rollout_correction(old, mu, torch.ones(1, 3), "token-tis", 2.0)
    assert c.weights.tolist()[0] == pytest.approx([1.0, 2.0, 0.5])
    assert c.loss_mask.tolist() == [[1, 1, 1]]
    assert c.metrics["rollout_is_mean"] == pytest.approx((1 + 4 + 0.5) / 3)
    assert c.metrics["rollout_is_clipped_frac"] == pytest.approx(1 / 3)
    w = torch.tensor([1.0, 4.0, 0.5])
    assert c.metrics["mismatch_kl"] == pytest.approx(float((w - w.log() - 1).mean()), rel=1e-5)


def test_seq_tis_weighs_every_token_by_its_sequences_product() -> None:
    old = _lp([0.0, 0.0], [0.0, 0.0])
    mu = _lp([-0.5, -0.5], [0.1, 0.0])  # w_seq = e^1 (> 2: truncated), e^-0.1
    c = rollout_correction(old, mu, torch.ones(2, 2), "seq-tis", 2.0)
    assert c.weights.tolist()[0] == pytest.approx([2.0, 2.0])
    assert c.weights.tolist()[1] == pytest.approx([math.exp(-0.1)] * 2, rel=1e-5)


def test_masked_is_removes_tokens_from_the_loss_and_from_its_denominators() -> None:
    old = _lp([0.0, 0.0, 0.0, 0.0])
    mu = _lp([0.0, -2.0, 2.0, -0.1])  # w = 1, e^2, e^-2, e^0.1; C = 2
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.int8)
    c = rollout_correction(old, mu, mask, "token-mis", 2.0)
    assert c.loss_mask.tolist() == [[1, 0, 0, 0]]
    norm = LossNorm.of(c.loss_mask, torch.ones(1), norm_len=4)
    assert norm.n_tokens == 1.0  # rejected tokens are not counted in T
    seq = rollout_correction(old[:, :2], mu[:, :2], mask[:, :2], "seq-mis", 2.0)
    assert seq.loss_mask.tolist() == [[0, 0]]  # the sequence's w = e^2 > C


def test_masked_is_batch_equals_the_batch_without_the_rejected_tokens() -> None:
    b = batch(seed=3)
    a1, a2 = actor(AlgoConfig(rollout_correction="token-mis")), actor()
    own = a2.logprobs(b)
    b.engine_logprobs[:] = own.numpy()
    b.engine_logprobs[0, 0] -= 5.0  # one token far off: w = e^5, rejected
    b.engine_logprobs[2, 1] += 5.0
    by_mask = copy.deepcopy(b)
    by_mask.loss_mask[0, 0] = by_mask.loss_mask[2, 1] = 0
    by_mask.engine_logprobs[:] = own.numpy()
    out = a1.update(b)
    ref = a2.update(by_mask)
    assert out["train/loss_tokens"] == ref["train/loss_tokens"] == b.n_loss_tokens - 2
    assert out["train/loss"] == pytest.approx(ref["train/loss"], abs=1e-6)
    assert out["train/rollout_is_clipped_frac"] == pytest.approx(2 / b.n_loss_tokens)


def test_a_mini_batch_emptied_by_masked_is_takes_no_step() -> None:
    a = actor(AlgoConfig(rollout_correction="seq-mis"))
    before = params(a)
    out = a.update(batch(engine_lp=-30.0))  # every sequence far from the actor: rejected
    assert out["train/skipped_mini_batches"] == 1.0 and out["train/optimizer_steps"] == 0.0
    assert out["train/rollout_is_clipped_frac"] == 1.0
    assert all(torch.equal(p, before[k]) for k, p in params(a).items())


def test_seq_mis_keeps_sequences_inside_the_bounds() -> None:
    old = _lp([0.0, 0.0], [0.0, 0.0])
    mu = _lp([-0.2, -0.2], [-2.0, 0.0])  # w_seq = e^0.4 (kept), e^2 (> 2: rejected)
    c = rollout_correction(old, mu, torch.ones(2, 2), "seq-mis", 2.0)
    assert c.loss_mask.tolist() == [[1, 1], [0, 0]]
    assert c.metrics["rollout_is_clipped_frac"] == 0.5


# -- dual-clip ---------------------------------------------------------------------------


def _one_token_loss(ratio: float, adv: float, c: float | None) -> tuple[float, float]:
    lp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    out = ppo_clip_loss(
        lp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64),
        torch.ones(1, 1), torch.ones(1), LossNorm(1.0, 1.0, 1.0), PolicyLossSpec(clip_ratio_c=c),
    )  # fmt: skip
    out.loss.backward()
    assert lp.grad is not None
    return float(out.loss.detach()), float(lp.grad)


def test_dual_clip_caps_negative_advantage_losses_and_their_gradient() -> None:
    loss, grad = _one_token_loss(5.0, -1.0, 3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0  # capped at |A|·c, no gradient
    loss, grad = _one_token_loss(5.0, -1.0, None)
    assert loss == pytest.approx(5.0) and grad == pytest.approx(5.0)  # unbounded without it
    loss, grad = _one_token_loss(2.0, -1.0, 3.0)
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0)  # below c: untouched
    loss, _ = _one_token_loss(5.0, 1.0, 3.0)
    assert loss == pytest.approx(-1.2)  # A > 0: the usual clip only


def test_dual_clip_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossSpec(clip_ratio_c=0.9)


# -- no loss tokens, no step ---------------------------------------------------------------


def test_a_mini_batch_without_loss_tokens_leaves_every_parameter_bit_identical() -> None:
    a = actor(weight_decay=0.1)
    a.update(batch())  # momentum and a step count exist now
    before, steps = params(a), a.optimizer_steps
    state = copy.deepcopy(a.optimizer.state_dict())
    empty = batch()
    empty.loss_mask[:] = 0
    out = a.update(empty)
    assert out["train/optimizer_steps"] == 0.0 and out["train/skipped_mini_batches"] == 1.0
    assert a.optimizer_steps == steps
    for name, p in params(a).items():
        assert torch.equal(p, before[name]), name
    after = a.optimizer.state_dict()["state"]
    for k, v in state["state"].items():
        assert all(torch.equal(v[n], after[k][n]) for n in v if torch.is_tensor(v[n]))


def test_a_step_with_a_non_finite_gradient_is_counted_as_not_taken() -> None:
    a = actor(mini_batches=2)
    before = params(a)
    huge = batch()
    huge.advantages = [x * 3e38 for x in huge.advantages]  # the gradient overflows
    out = a.update(huge)
    assert a.optimizer_steps == 0 and out["train/optimizer_steps"] == 0.0
    assert out["train/nonfinite_grad_steps"] == 2.0
    assert all(torch.equal(p, before[k]) for k, p in params(a).items())
    out = a.update(batch())
    assert out["train/optimizer_steps"] == 2.0 and out["train/nonfinite_grad_steps"] == 0.0


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_the_flop_count_runs_the_reference_model_once_per_epoch(kl_coef: float) -> None:
    counted: list[int] = []
    cfg = ActorConfig(lr=1e-2, micro_batch_rows=4, epochs=3, mini_batches=2)
    algo = AlgoConfig(kl_coef=kl_coef)
    a = Actor(tiny_policy(VOCAB), cfg, algo, norm_len=16, temperature=0.7,
              ref_model=tiny_policy(VOCAB))  # fmt: skip
    if a.ref is not None:  # count the reference model's forward passes over the batch
        a.ref.register_forward_hook(lambda m, i, o: counted.append(i[0].shape[0]))
    b = batch()
    out = a.update(b)
    per_token = out["perf/train_flops"] / (out["perf/params"] * out["perf/train_tokens"] / 3)
    ref_passes = sum(counted) / sum(b.row_valid)  # rows it ran over, in batch sizes
    assert ref_passes == (3.0 if kl_coef else 0.0)
    assert per_token == pytest.approx(6.0 * 3 + 2.0 * ref_passes + 2.0)  # + the π_old scoring


# -- failures ----------------------------------------------------------------------------


def test_failures_are_grouped_by_cause_with_numbers_and_ids_set_aside() -> None:
    def failed(i: int, error: str) -> Sample:
        return Sample(index=i, status=Status.FAILED, error=error)

    samples = [
        failed(0, "EngineError: prompt of 3165 tokens leaves no room in max_seq_len 512"),
        failed(1, "EngineError: prompt of 2990 tokens leaves no room in max_seq_len 512"),
        failed(2, "ValueError: no reward function for data_source 'x'"),
        Sample(index=3, status=Status.COMPLETED),
        Sample(index=4, status=Status.ABORTED),
    ]
    summary = failure_summary(samples)
    assert (summary.failed, summary.ended) == (3, 4)
    assert summary.line() == (
        "3/4 samples failed — EngineError: prompt of 3165 tokens leaves no room in "
        "max_seq_len 512 (2); ValueError: no reward function for data_source 'x' (1)"
    )


# -- missing engine log-probs --------------------------------------------------------------


def _no_logprob_run(tokenizer: Any, require: bool) -> Sample:
    from fakes.scripted_engine import ScriptedEngine
    from tailcut.rollout.agent_loop import AgentLoop
    from tailcut.rollout.cutoff import WaitAll
    from tailcut.rollout.scheduler import run_step
    from tailcut.trace.events import NULL_TRACER
    from tailcut.types import GenerateRequest, GenerateResult
    from tailcut.vtime import run_virtual

    class NoLogprobs(ScriptedEngine):
        name = "no-logprobs"

        async def _generate(self, request: GenerateRequest) -> GenerateResult:
            result = await super()._generate(request)
            return GenerateResult(result.request_id, result.output_ids, result.finish_reason, None)

    engine = NoLogprobs(tokenizer, lambda call: "#### 1")
    loop = AgentLoop(tokenizer, require_logprobs=require)
    sample = Sample(index=0, data={"prompt": [{"role": "user", "content": "q"}]})
    run_virtual(run_step(engine, [sample], loop, WaitAll(1), NULL_TRACER))
    return sample


def test_missing_engine_logprobs_fail_the_sample_when_training_reads_them(
    chat_tokenizer: Any,
) -> None:
    s = _no_logprob_run(chat_tokenizer, require=True)
    assert s.status is Status.FAILED
    assert s.error is not None and "engine no-logprobs returned no log-prob for" in s.error
    assert s.turns[0].request_id in s.error


def test_missing_engine_logprobs_are_nan_never_zero_otherwise(chat_tokenizer: Any) -> None:
    s = _no_logprob_run(chat_tokenizer, require=False)
    assert s.status is Status.COMPLETED
    sampled = [lp for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m]
    assert sampled and all(math.isnan(x) for x in sampled)


def test_servers_get_a_fresh_seed_for_a_continued_generation_never_the_first_draws() -> None:
    from tailcut.types import SamplingParams

    assert SamplingParams(seed=5).stream_seed() == 5
    assert SamplingParams(seed=None, seed_offset=3).stream_seed() is None
    derived = {SamplingParams(seed=5, seed_offset=k).stream_seed() for k in range(1, 50)}
    assert len(derived) == 49 and 5 not in derived
    assert (
        SamplingParams(seed=5, seed_offset=7).stream_seed()
        == SamplingParams(seed=5, seed_offset=7).stream_seed()
    )


def test_each_server_is_sent_the_seed_that_continues_its_stream() -> None:
    from tailcut.config import RemoteEngineConfig
    from tailcut.engine.sglang import sampling_params
    from tailcut.engine.vllm import VLLMEngine
    from tailcut.types import GenerateRequest, SamplingParams, new_request_id

    def request(offset: int) -> GenerateRequest:
        return GenerateRequest(new_request_id(), [1, 2], SamplingParams(seed=5, seed_offset=offset))

    vllm = VLLMEngine(["http://127.0.0.1:9"], RemoteEngineConfig(model_name="m"))
    assert vllm.body(request(0))["seed"] == 5
    assert vllm.body(request(4))["seed"] == SamplingParams(seed=5, seed_offset=4).stream_seed() != 5
    # SGLang keys its seeded draws by position: prompt + prior tokens continue the stream.
    assert sampling_params(request(4))["sampling_seed"] == 5


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        (["cutoff.aborted=partial"], "token-tis"),
        (["cutoff.long_rounds=true"], "token-tis"),
        (["cutoff.aborted=partial", "algo.rollout_correction=seq-mis"], "seq-mis"),
        (["cutoff.aborted=partial", "algo.rollout_correction=none"], "none"),
        (["cutoff.aborted=partial", "algo.old_logprobs=engine"], "none"),
        (["cutoff.aborted=mask"], "none"),
        ([], "none"),
    ],
)
def test_tokens_of_an_older_policy_are_corrected_unless_said_otherwise(
    overrides: list[str], want: str
) -> None:
    """Resumed trajectories and long rounds train tokens an older policy sampled, whose PPO
    ratio is 1 (π_old is the current actor's): the rollout correction is on for them
    unless the config says otherwise."""
    cfg = load_train_config(None, ["engine.kind=hf", "agent.temperature=0.7", *overrides])
    assert cfg.algo.rollout_correction == want
