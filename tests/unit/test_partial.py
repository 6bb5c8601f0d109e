"""Partial-rollout buffer: resumed trajectories keep tokens, versions, log-probs; staleness."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from tailcut.algo.metrics import partial_metrics
from tailcut.rollout.partial import PartialBuffer
from tailcut.types import FinishReason, Sample, Status, Turn


def aborted(index: int, group: int, n: int = 3, version: int = 0) -> Sample:
    return Sample(
        index=index,
        group=group,
        prompt_ids=[1, 2, 3],
        status=Status.ABORTED,
        finish_reason=FinishReason.ABORT,
        response_ids=list(range(10, 10 + n)),
        loss_mask=[1] * n,
        logprobs=[-0.25] * n,
        versions=[version] * n,
        turns=[Turn(0, "x" * 24, 3, output_tokens=n, finish_reason=FinishReason.ABORT)],
        messages=[{"role": "user", "content": "q"}],
        active_request_id="y" * 24,
        launched_at=1.0,
        ended_at=2.0,
    )


def test_resume_keeps_tokens_versions_and_logprobs() -> None:
    buf = PartialBuffer(max_staleness=1)
    s = aborted(4, 7, version=3)
    assert buf.add([s], step=5, finished_rewards={7: [1.0, 0.0]}) == 1
    out = buf.take(step=6)
    assert len(out.resumed) == 1 and len(buf) == 0
    r = out.resumed[0]
    assert r is not s
    assert r.status is Status.PENDING and r.finish_reason is None
    assert list(r.prompt_ids) == [1, 2, 3] and list(r.response_ids) == [10, 11, 12]
    assert list(r.versions) == [3, 3, 3] and list(r.logprobs) == [-0.25] * 3
    assert list(r.loss_mask) == [1] * 3
    assert len(r.turns) == 1 and r.messages == s.messages
    assert r.resumed_from_step == 5 and r.active_request_id is None and r.launched_at is None
    assert buf.baseline_rewards([7]) == {7: [1.0, 0.0]}


def test_group_baseline_recorded_once_per_group() -> None:
    buf = PartialBuffer(max_staleness=1)
    buf.add([aborted(0, 7), aborted(1, 7)], step=2, finished_rewards={7: [1.0, 0.0]})
    assert buf.baseline_rewards([7]) == {7: [1.0, 0.0]}
    assert len(buf.take(step=3).resumed) == 2


def test_staleness_bound_drops_and_counts() -> None:
    buf = PartialBuffer(max_staleness=1)
    buf.add([aborted(0, 0), aborted(1, 1)], step=0)
    first = buf.take(step=1, limit=1)
    assert len(first.resumed) == 1 and len(buf) == 1
    # Cut again at step 1: started at step 0, so step 2 would be 2 steps stale.
    again = first.resumed[0]
    again.status = Status.ABORTED
    assert buf.add([again], step=1) == 0
    late = buf.take(step=2)
    assert late.resumed == [] and buf.dropped_total == 2 and buf.baselines == {}
    lost = buf.pop_lost()  # one cut again too late (add), one left waiting too long (take)
    assert sorted(s.index for s in lost) == [0, 1] and buf.pop_lost() == []
    metrics = partial_metrics(len(late.resumed), lost, len(buf), buf.dropped_total)
    assert metrics["partial/expired"] == 2.0
    assert metrics["partial/expired_tokens"] == sum(s.generated_tokens for s in lost) > 0


def test_zero_staleness_is_drop() -> None:
    buf = PartialBuffer(max_staleness=0)
    assert buf.add([aborted(0, 0)], step=3) == 0
    assert buf.take(step=4).resumed == [] and buf.dropped_total == 1


def test_only_aborted_samples_enter() -> None:
    s = aborted(2, 1)
    s.status = Status.FAILED
    with pytest.raises(ValueError, match=r"sample 2 \(group 1\) is failed"):
        PartialBuffer().add([s], step=0)


def test_release_forgets_finished_groups_and_state_round_trips() -> None:
    buf = PartialBuffer(max_staleness=2)
    buf.add([aborted(0, 3), aborted(1, 4)], step=0, finished_rewards={3: [0.5], 4: [1.0]})
    state = pickle.loads(pickle.dumps(buf.state_dict()))
    other = PartialBuffer(max_staleness=2)
    other.load_state_dict(state)
    assert [e.sample.index for e in other.entries] == [0, 1]
    assert other.baselines == {3: [0.5], 4: [1.0]}
    taken = other.take(step=1, limit=1)
    assert [s.group for s in taken.resumed] == [3]
    other.release([3])
    assert other.baseline_rewards([3, 4]) == {4: [1.0]}


# -- resuming a cut trajectory with the agent loop ------------------------------------------


def _question_sample(index: int, question: str) -> Sample:
    prompt = [{"role": "system", "content": "Answer."}, {"role": "user", "content": question}]
    return Sample(index=index, group=index, data={"prompt": prompt})


def _cut_step(tokenizer: object, script: object) -> tuple[object, list[Sample]]:
    from fakes.scripted_engine import ScriptedEngine
    from tailcut.rollout.cutoff import TargetCount
    from tailcut.rollout.resume import ResumableAgentLoop
    from tailcut.rollout.scheduler import run_step
    from tailcut.trace.events import NULL_TRACER
    from tailcut.vtime import run_virtual

    engine = ScriptedEngine(tokenizer, script, token_delay_s=0.01, weight_version=3)  # type: ignore[arg-type]
    loop = ResumableAgentLoop(tokenizer, reward_fn=lambda s, t: 1.0)  # type: ignore[arg-type]
    samples = [_question_sample(0, "short"), _question_sample(1, "long")]
    result = run_virtual(run_step(engine, samples, loop, TargetCount(2, 1, 0.5), NULL_TRACER))
    return engine, result.samples


def _run_resumed(
    tokenizer: object, script: object, sample: Sample, version: int, tracer: object = None
) -> object:
    from fakes.scripted_engine import ScriptedEngine
    from tailcut.rollout.cutoff import WaitAll
    from tailcut.rollout.resume import ResumableAgentLoop
    from tailcut.rollout.scheduler import run_step
    from tailcut.trace.events import NULL_TRACER
    from tailcut.vtime import run_virtual

    engine = ScriptedEngine(tokenizer, script, token_delay_s=0.01, weight_version=version)  # type: ignore[arg-type]
    loop = ResumableAgentLoop(tokenizer, reward_fn=lambda s, t: 1.0)  # type: ignore[arg-type]
    run_virtual(run_step(engine, [sample], loop, WaitAll(1), tracer or NULL_TRACER))  # type: ignore[arg-type]
    return engine


def test_resume_mid_generation_continues_from_prompt_plus_tokens(
    chat_tokenizer: object, tmp_path: Path
) -> None:
    from fakes.scripted_engine import ramble
    from tailcut.trace.events import Tracer, read_trace

    def script(call: object) -> str:
        return "#### 1" if "short" in call.prompt_text else ramble(40)  # type: ignore[attr-defined]

    _, done = _cut_step(chat_tokenizer, script)
    cut = done[1]
    assert cut.status is Status.ABORTED and len(cut.response_ids) > 0
    partial_ids, partial_versions = list(cut.response_ids), list(cut.versions)
    buf = PartialBuffer(max_staleness=1)
    buf.add([cut], step=1)
    resumed = buf.take(step=2).resumed[0]
    resumed.index = 0
    with Tracer(tmp_path / "trace.jsonl", step=2) as tracer:
        engine = _run_resumed(chat_tokenizer, script, resumed, version=4, tracer=tracer)
    assert resumed.status is Status.COMPLETED and resumed.reward == 1.0
    n = len(partial_ids)
    call = next(e for e in read_trace(tmp_path / "trace.jsonl") if e["event"] == "turn_engine_call")
    # The turn's tokens so far, and what this call decoded after the n it continued from.
    assert call["extra"]["output_tokens"] == n + call["extra"]["new_tokens"]
    assert call["extra"]["new_tokens"] == len(resumed.response_ids) - n
    assert list(resumed.response_ids[:n]) == partial_ids
    assert list(resumed.versions[:n]) == partial_versions
    assert set(resumed.versions[n:]) == {4} and len(resumed.response_ids) > n
    first = engine.requests[0]  # type: ignore[attr-defined]
    assert list(first.prompt_ids) == [*resumed.prompt_ids, *partial_ids]  # prompt + tokens so far
    assert resumed.messages[-1]["role"] == "assistant"
    assert len(resumed.loss_mask) == len(resumed.response_ids) == len(resumed.logprobs)


class SlowTool:
    """Answers ``7`` after ``delay_s`` of virtual time."""

    name = "slow"

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0

    def schema(self) -> dict[str, object]:
        return {"type": "function", "function": {"name": "slow", "parameters": {"type": "object"}}}

    async def create(self, instance_id: str, **kwargs: object) -> None:
        return None

    async def execute(self, instance_id: str, arguments: dict[str, object]) -> object:
        import asyncio

        from tailcut.tools.base import ToolResult

        self.calls += 1
        await asyncio.sleep(self.delay_s)
        return ToolResult("7")

    async def calc_reward(self, instance_id: str) -> float:
        return 0.0

    async def release(self, instance_id: str) -> None:
        return None


def test_resume_cut_inside_tool_call_replays_the_calls(chat_tokenizer: object) -> None:
    from fakes.scripted_engine import ScriptedEngine, ramble
    from tailcut.chat.parser import format_tool_call
    from tailcut.rollout.cutoff import TargetCount, WaitAll
    from tailcut.rollout.resume import ResumableAgentLoop
    from tailcut.rollout.scheduler import run_step
    from tailcut.tools.base import ToolSet
    from tailcut.trace.events import NULL_TRACER
    from tailcut.vtime import run_virtual

    def script(call: object) -> str:
        if call.turn > 0:  # type: ignore[attr-defined]
            return "#### 7"
        if "short" in call.prompt_text:  # type: ignore[attr-defined]
            return ramble(80) + "\n#### 7"  # done while the other one waits on its tool
        return "Ask.\n" + format_tool_call("slow", {})

    tool = SlowTool(delay_s=5.0)
    loop = ResumableAgentLoop(
        chat_tokenizer, toolset=ToolSet({"slow": tool}), reward_fn=lambda s, t: 1.0
    )  # type: ignore[arg-type]
    engine = ScriptedEngine(chat_tokenizer, script, token_delay_s=0.01)  # type: ignore[arg-type]
    samples = [_question_sample(0, "long"), _question_sample(1, "short")]
    run_virtual(run_step(engine, samples, loop, TargetCount(2, 1, 0.5), NULL_TRACER))
    cut = samples[0]
    assert cut.status is Status.ABORTED and cut.turns[-1].finish_reason is FinishReason.STOP
    assert cut.messages[-1]["role"] == "assistant" and tool.calls == 1
    before = list(cut.response_ids)
    buf = PartialBuffer()
    buf.add([cut], step=1)
    resumed = buf.take(step=2).resumed[0]
    resumed.index = 0
    engine2 = ScriptedEngine(chat_tokenizer, script, token_delay_s=0.01)  # type: ignore[arg-type]
    run_virtual(run_step(engine2, [resumed], loop, WaitAll(1), NULL_TRACER))
    assert resumed.status is Status.COMPLETED and tool.calls == 2  # the cut call ran again
    assert list(resumed.response_ids[: len(before)]) == before
    assert len(engine2.requests) == 1  # no new generation for the replayed turn
    assert [m["role"] for m in resumed.messages[-3:]] == ["assistant", "tool", "assistant"]
    assert resumed.messages[-1]["content"] == "#### 7"


def test_settle_gives_earlier_baselines_then_keeps_the_deferred_and_this_steps_rewards():
    from tailcut.algo.batch import plan_rows

    def done(i: int, group: int, reward: float) -> Sample:
        return Sample(index=i, group=group, status=Status.COMPLETED, reward=reward)

    buf = PartialBuffer(max_staleness=2)
    cut = Sample(index=1, group=7, status=Status.ABORTED)
    # Step 1: one member of group 7 finished (a lone row: small_group=drop leaves it out of
    # the batch, but its reward is still a draw of the group's), one was cut.
    rows = plan_rows([done(0, 7, 1.0), cut], None, "partial")
    assert buf.settle(1, rows) == {}  # no earlier members: no baseline yet
    assert len(buf) == 1 and buf.baseline_rewards([7]) == {7: [1.0]}
    # Step 2: the resumed member finishes; its baseline is the member trained in step 1.
    (resumed,) = buf.take(2).resumed
    resumed.status, resumed.reward = Status.COMPLETED, 0.0
    rows = plan_rows([resumed], None, "partial")
    assert buf.settle(2, rows) == {7: [1.0]}
    assert len(buf) == 0 and buf.baseline_rewards([7]) == {}  # nothing left in flight


def test_a_surplus_finisher_is_in_its_groups_baseline():
    """The cut kept one of group 7's finishers (its quota full), the other is surplus: no
    row, but its reward is a draw of the group — the resumed member's baseline holds both
    (surplus finishers are the later, longer ones: leaving them out leans to short draws)."""
    from tailcut.algo.batch import plan_rows

    def done(i: int, reward: float) -> Sample:
        return Sample(index=i, group=7, status=Status.COMPLETED, reward=reward)

    buf = PartialBuffer(max_staleness=2)
    cut = Sample(index=2, group=7, status=Status.ABORTED)
    rows = plan_rows([done(0, 1.0), done(1, 0.0), cut], [0], "partial")
    assert rows.counts.surplus == 1 and [s.index for s in rows.surplus] == [1]
    buf.settle(1, rows)
    assert buf.baseline_rewards([7]) == {7: [1.0, 0.0]}


def test_a_cut_generation_that_had_sampled_its_stop_token_is_not_continued(
    chat_tokenizer: object,
) -> None:
    """An abort that raced the end of a generation returns its stop token: resumed, the
    turn is replayed as ended (no engine call continues after the end of turn)."""
    from fakes.scripted_engine import ramble
    from tailcut.chat.template import stop_token_ids

    def script(call: object) -> str:
        return "#### 1" if "short" in call.prompt_text else ramble(40)  # type: ignore[attr-defined]

    _, done = _cut_step(chat_tokenizer, script)
    cut = done[1]
    eos = stop_token_ids(chat_tokenizer)[0]  # type: ignore[arg-type]
    cut.response_ids.append(eos)
    cut.loss_mask.append(1)
    cut.logprobs.append(-0.5)
    cut.versions.append(3)
    cut.turns[-1].output_tokens += 1
    buf = PartialBuffer(max_staleness=1)
    buf.add([cut], step=1)
    resumed = buf.take(step=2).resumed[0]
    resumed.index = 0
    engine = _run_resumed(chat_tokenizer, script, resumed, version=4)
    assert engine.requests == []  # type: ignore[attr-defined]
    assert resumed.status is Status.COMPLETED and resumed.finish_reason is FinishReason.STOP
    assert resumed.response_ids[-1] == eos and set(resumed.versions) == {3}
