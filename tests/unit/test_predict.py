import json
import math

import pytest

from tailcut.rollout.predict import LengthPredictor, conditional_mean, prompt_key, ranks, spearman
from tailcut.types import Sample, Status, Turn, token_array


def _sample(index: int, group: int, tokens: int, status: Status, prompt: int) -> Sample:
    s = Sample(index=index, group=group, data={"prompt_id": prompt})
    s.turns.append(Turn(0, f"r{index:07d}", 4, output_tokens=tokens))
    s.status = status
    return s


def test_ranks_and_spearman():
    assert ranks([10.0, 30.0, 20.0, 20.0]) == [1.0, 4.0, 2.5, 2.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert spearman([1, 1, 1], [1, 2, 3]) == 0.0


def test_conditional_mean_is_the_mean_without_a_bound_and_above_any_bound():
    assert math.isclose(conditional_mean(0.0, 1.0, 0.0), math.exp(0.5))
    for lower in (0.5, 1.0, 10.0, 1e6):
        assert conditional_mean(0.0, 1.0, lower) > lower
    assert conditional_mean(0.0, 1.0, 10.0) > conditional_mean(0.0, 1.0, 1.0)


def test_prompt_key_prefers_the_rows_prompt_id():
    assert prompt_key(Sample(index=0, data={"prompt_id": 7})) == 7
    a, b = Sample(index=0, prompt_ids=[1, 2]), Sample(index=1, prompt_ids=[1, 2])
    assert prompt_key(a) == prompt_key(b)


def _epoch(pred: LengthPredictor, lengths: dict[int, int], start: int = 0) -> None:
    """One step: prompts p with 8 members each of about lengths[p] tokens."""
    samples = []
    for p, n in lengths.items():
        for m in range(8):
            tokens = int(n * (0.9 + 0.2 * m / 7))
            samples.append(_sample(start + len(samples), p, tokens, Status.COMPLETED, p))
    pred.end_step(samples)


def test_history_of_a_prompt_ranks_its_next_epoch():
    pred = LengthPredictor()
    lengths = {p: 100 * (1 + p) for p in range(12)}
    _epoch(pred, lengths)
    _epoch(pred, lengths)  # a second epoch: the history is measured to predict
    assert pred.history_weight > 0.9
    samples = [Sample(index=i, group=p, data={"prompt_id": p}) for i, p in enumerate(lengths)]
    pred.start_step(samples)
    preds = [pred.remaining(i) for i in range(len(samples))]
    assert spearman(preds, list(lengths.values())) == 1.0


def test_a_rows_history_is_found_at_launch_before_its_prompt_is_rendered():
    """Training rows carry their prompt as messages; the agent loop renders the tokens only
    once the trajectory runs. Learned from finished members (tokens rendered), a prompt's
    history must be found for its fresh members at the next launch (no tokens yet)."""

    def row(p: int) -> dict[str, object]:
        return {"messages": [{"role": "user", "content": f"question {p}"}]}

    pred = LengthPredictor()
    lengths = {p: 100 * (1 + p) for p in range(12)}
    for _ in range(2):
        done = []
        for p, n in lengths.items():
            for m in range(8):
                s = _sample(len(done), p, int(n * (0.9 + 0.2 * m / 7)), Status.COMPLETED, p)
                s.data = row(p)
                s.prompt_ids = token_array([7, p, p + 1])  # rendered by the agent loop
                done.append(s)
        pred.end_step(done)
    fresh = [Sample(index=i, group=p, data=row(p)) for i, p in enumerate(lengths)]
    pred.start_step(fresh)
    preds = [pred.remaining(i) for i in range(len(fresh))]
    assert spearman(preds, list(lengths.values())) == 1.0


def test_no_signal_predicts_the_same_for_everyone():
    pred = LengthPredictor()
    same = dict.fromkeys(range(12), 500)
    _epoch(pred, same)
    _epoch(pred, same)
    assert math.isinf(pred.shrink)  # prompts share nothing: the global level for all
    samples = [Sample(index=i, group=p, data={"prompt_id": p}) for i, p in enumerate(same)]
    pred.start_step(samples)
    assert len({round(pred.remaining(i), 6) for i in range(12)}) == 1


def test_finished_siblings_and_own_progress_move_the_prediction():
    pred = LengthPredictor()
    _epoch(pred, {p: 100 * (1 + p) for p in range(12)})
    samples = [Sample(index=i, group=i // 2, data={"prompt_id": 100 + i}) for i in range(4)]
    pred.start_step(samples)
    before = pred.remaining(1)
    assert pred.sibling_done(0, 5000) == [1]
    assert pred.remaining(1) > before  # a long sibling: a hard prompt
    assert pred.remaining(1, tokens_so_far=3000) > 0


def test_censored_samples_teach_a_longer_length_than_they_reached():
    done, cut = LengthPredictor(), LengthPredictor()
    done.end_step(
        [_sample(0, 0, 400, Status.COMPLETED, 1), _sample(1, 0, 400, Status.COMPLETED, 1)]
    )
    cut.end_step([_sample(0, 0, 400, Status.COMPLETED, 1), _sample(1, 0, 400, Status.ABORTED, 1)])
    assert cut.level > done.level


def test_members_of_one_length_per_prompt_predict_the_level_for_a_new_prompt():
    """Greedy decoding (or a deterministic workload): no spread within a prompt, so the
    global level weighs nothing beside a prompt's own lengths (k = 0). A prompt never seen,
    no member finished, is predicted the level; one with a finished member, that length."""
    pred = LengthPredictor()
    done = [_sample(4 * g + m, g, 100 * (g + 1), Status.COMPLETED, g)
            for g in range(4) for m in range(4)]  # fmt: skip
    pred.end_step(done)
    assert pred.sigma_within == 0.0 and pred.shrink == 0.0
    fresh = [_sample(i, 10 + i // 4, 0, Status.PENDING, 10 + i // 4) for i in range(8)]
    pred.start_step(fresh)
    assert math.isclose(pred.prompt_level(0), pred.level)
    assert math.isfinite(pred.remaining(0))
    pred.sibling_done(0, 300)
    assert math.isclose(pred.prompt_level(1), math.log(300))


def _two_turns(index: int, group: int, first: int, total: int, prompt: int) -> Sample:
    """A finished two-turn trajectory; prompt ``prompt`` known by its tokens (no id)."""
    s = Sample(index=index, group=group, prompt_ids=[7, prompt])
    s.turns.append(Turn(0, f"r{index:07d}", 4, output_tokens=first))
    s.turns.append(Turn(1, f"s{index:07d}", 4, output_tokens=total - first))
    s.status = Status.COMPLETED
    return s


def test_a_restored_predictor_predicts_and_learns_as_the_one_it_was_saved_from():
    """Histories (by prompt id and by prompt tokens), epoch pairs and progress fits all
    survive a JSON round trip of the state: the copy predicts the same, before and after
    both learn one more step."""
    pred = LengthPredictor()
    lengths = {p: 100 * (1 + p) for p in range(12)}
    for _ in range(2):
        _epoch(pred, lengths)
        pred.end_step(_two_turns(i, 50 + i // 4, 10 + 3 * i, 60 + 9 * i, i // 4) for i in range(40))
    assert pred.history_weight > 0.0 and pred.remaining(0, 40, 1) != pred.remaining(0, 40)
    copy = LengthPredictor()
    copy.load_state_dict(json.loads(json.dumps(pred.state_dict())))
    assert copy.state_dict() == pred.state_dict()
    launched = [
        *(Sample(index=i, group=i, data={"prompt_id": p}) for i, p in enumerate(lengths)),
        *(_two_turns(12 + i, 12 + i, 0, 0, i) for i in range(3)),
    ]
    for step in range(2):
        for p in (pred, copy):
            p.start_step(launched)
            p.sibling_done(3, 700)
        for i in range(len(launched)):
            for tokens, turns in ((0, 0), (50, 1), (120, 2)):
                assert copy.remaining(i, tokens, turns) == pred.remaining(i, tokens, turns)
        if step == 0:
            for p in (pred, copy):
                _epoch(p, {q: n + 37 for q, n in lengths.items()})


def test_a_predictor_state_of_another_version_is_refused():
    state = LengthPredictor().state_dict()
    with pytest.raises(ValueError, match="version 2"):
        LengthPredictor().load_state_dict({**state, "version": 2})
