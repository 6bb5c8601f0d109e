from tailcut.bench.scheduled import TrueRemaining, bias_length, make_admission
from tailcut.bench.sim_bench import BenchOptions, build_policy
from tailcut.bench.sim_step import run_policy_step
from tailcut.bench.workloads import Trajectory, TurnSpec
from tailcut.config import SimEngineConfig
from tailcut.rollout.admission import Admission
from tailcut.rollout.spf import ShortestPredictedFirst
from tailcut.types import Status


def _pool(n: int = 40) -> list[Trajectory]:
    # Two turns each; every 10th trajectory is 8× longer (the stragglers).
    out = []
    for i in range(n):
        k = 8 if i % 10 == 9 else 1
        turns = (TurnSpec(40 * k + i, 0.05, 4), TurnSpec(30 * k))
        out.append(Trajectory(turns, group=i // 4, prompt_tokens=8, prompt=i // 4))
    return out


def _run(admission=None):
    opts = BenchOptions(requests=40, target_fraction=0.9, group_size=4)
    policy = build_policy("target-count", opts)
    res, _, after = run_policy_step(policy, _pool(), SimEngineConfig(), admission=admission)
    return res, after


def test_clairvoyant_admission_holds_the_stragglers_and_cuts_sooner():
    plain, _ = _run()
    adm = Admission(ShortestPredictedFirst(TrueRemaining(), margin=0.0))
    held, after = _run(adm)
    assert len(held.kept) == len(plain.kept) == 36
    assert all(s.status in (Status.COMPLETED, Status.ABORTED) for s in held.samples)
    assert after == 0
    stragglers = [s for s in held.samples if s.index % 10 == 9]
    assert all(s.status is Status.ABORTED for s in stragglers)
    # 36 needed + a margin of 1 allowed: the 3 longest are held, never in the engine
    assert sorted(s.generated_tokens == 0 for s in stragglers) == [False, True, True, True]
    assert adm.held_calls == 3
    assert held.step_time_s < plain.step_time_s


def test_a_wrong_prediction_costs_time_never_a_kept_sample():
    class Backwards(TrueRemaining):
        def remaining(self, index, tokens_so_far=0, turns_done=0):
            return -super().remaining(
                index, tokens_so_far, turns_done
            )  # the longest looks shortest

    plain, _ = _run()
    wrong, _ = _run(Admission(ShortestPredictedFirst(Backwards(), margin=0.0)))
    assert len(wrong.kept) == len(plain.kept)
    assert all(wrong.samples[i].status is Status.COMPLETED for i in wrong.kept)
    assert wrong.step_time_s >= plain.step_time_s


def test_requests_carry_the_schedules_priority():
    seen: list[int | None] = []

    class Recording(ShortestPredictedFirst):
        def priority(self, index):
            p = super().priority(index)
            seen.append(p)
            return p

    _run(Admission(Recording(TrueRemaining(), margin=1.0)))
    assert seen and all(isinstance(p, int) and p >= 0 for p in seen)


def test_bias_length_and_the_bench_admissions():
    pool = _pool()
    assert bias_length(pool, range(len(pool))) == 1.0
    assert bias_length(pool, [0, 1]) < 1.0
    opts = BenchOptions()
    assert make_admission("target-count", opts) is None
    assert make_admission("spf+target-count", opts) is not None


def test_an_outside_cut_cancels_the_held_calls_and_every_sample_ends_once():

    from tailcut.bench.workloads import make_samples
    from tailcut.engine.sim import SimEngine
    from tailcut.rollout.cutoff import TargetCount
    from tailcut.rollout.scheduler import CutHandle, run_step
    from tailcut.rollout.scripted import ScriptedRollout
    from tailcut.trace.events import NULL_TRACER
    from tailcut.vtime import run_virtual

    ended: list[int] = []
    handle = CutHandle()

    def done(sample):  # a global coordinator: cut every worker once 20 are usable
        ended.append(sample.index)
        if sum(1 for i in ended if samples[i].status is Status.COMPLETED) == 20:
            handle.cut("global")

    handle.on_sample_done = done
    samples = make_samples(_pool())
    adm = Admission(ShortestPredictedFirst(TrueRemaining(), margin=0.0))

    async def main():
        engine = SimEngine(SimEngineConfig())
        # this worker's share is 36 of 40: the outside cut comes first, with the longest
        # still held at the gate
        res = await run_step(
            engine,
            samples,
            ScriptedRollout(),
            TargetCount(40, 1, 0.1),
            NULL_TRACER,
            control=handle,
            admission=adm,
        )
        assert await engine.in_flight() == []
        return res

    res = run_virtual(main())
    assert sorted(ended) == list(range(40))  # every sample ended exactly once
    assert res.cut_reason == "global"
    assert res.completed >= 20 and res.completed + res.aborted == 40
    assert adm.held_calls == 3
    held = [s for s in res.samples if s.index % 10 == 9 and s.generated_tokens == 0]
    assert len(held) == 3 and all(s.status is Status.ABORTED for s in held)


def test_the_schedule_config_builds_the_admission():
    from tailcut.config import ScheduleConfig
    from tailcut.rollout.admission import make_admission as from_config

    assert from_config(ScheduleConfig()) is None
    adm = from_config(ScheduleConfig(kind="spf", margin=0.2, need_ratio=0.5))
    assert adm is not None and adm.schedule.margin == 0.2 and adm.schedule.need_ratio == 0.5


class _Fixed:
    """A hand-written predictor: each trajectory's remaining work is given."""

    def __init__(self, remaining: dict[int, float]) -> None:
        self.table = remaining

    def start_step(self, samples):  # type: ignore[no-untyped-def]
        return None

    def remaining(self, index: int, tokens_so_far: int = 0, turns_done: int = 0) -> float:
        return self.table[index]

    def sibling_done(self, index: int, tokens: int) -> list[int]:
        return []

    def end_step(self, samples):  # type: ignore[no-untyped-def]
        return None


def test_a_sample_aborted_without_a_cut_lets_a_held_call_in():
    """Keep 1 of 4: the two longest predicted are held. One of the two allowed in ends
    aborted by the engine itself (no cut): the threshold rises and the next held call goes
    in at once, instead of waiting for an event that may never come."""
    import asyncio

    from tailcut.types import FinishReason, GenerateRequest, Sample, SamplingParams, new_request_id

    samples = [Sample(index=i, group=i, prompt_ids=[1]) for i in range(4)]
    adm = Admission(ShortestPredictedFirst(_Fixed({0: 1.0, 1: 2.0, 2: 10.0, 3: 20.0}), margin=0.0))
    adm.start(samples, 1)
    request = GenerateRequest(new_request_id(), [1], SamplingParams(max_new_tokens=4))

    async def main() -> bool:
        held = asyncio.ensure_future(adm.enter(samples[2], request))
        await asyncio.sleep(0)
        assert not held.done() and adm.held_calls == 1
        samples[0].status, samples[0].finish_reason = Status.ABORTED, FinishReason.ABORT
        adm.done(samples[0])
        await asyncio.sleep(0)
        return held.done()

    assert asyncio.run(main())
