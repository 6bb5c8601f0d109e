"""Rewards: GSM8K (verl's scores), DAPO ``Answer:``, math-verify off the loop, the registry,
and a raising reward function making the sample FAILED (never a silent 0)."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tailcut.data import arith
from tailcut.reward.arith import arith_score, extract_integer
from tailcut.reward.dapo import dapo_score, normalize_answer
from tailcut.reward.gsm8k import extract_answer, gsm8k_score
from tailcut.reward.math import MathVerifier
from tailcut.reward.registry import (
    RewardError,
    RewardInput,
    RewardOutput,
    RewardRegistry,
    default_registry,
    sample_reward_fn,
)
from tailcut.types import Sample

pytestmark = pytest.mark.timeout(120)

STUCK_WORKER = [sys.executable, str(Path(__file__).parents[1] / "fakes" / "stuck_math_worker.py")]


# -- GSM8K ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("so she sold 48 + 24 = 72 clips.\n#### 72", "72", "72"),
        ("#### 1,234", "1234", "1234"),
        ("#### -5 and later #### 6", "6", "6"),
        ("The answer is 72.", None, "72"),
        ("#### 18.", "18", "18"),
        ("#### $18", None, "18"),  # verl's strict pattern has no room for a $
        ("no numbers here", None, None),
        ("#### x", None, None),
        ("ends with a dot.", None, None),
        ("####72", None, "72"),  # strict needs the space verl's prompt asks for
    ],
)
def test_gsm8k_extraction(text: str, strict: str | None, flexible: str | None) -> None:
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_gsm8k_scores_are_verls() -> None:
    assert gsm8k_score("#### 72", "72") == 1.0
    assert gsm8k_score("#### 71", "72") == 0.0
    assert gsm8k_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_score("no answer", "72", format_score=0.1) == 0.0
    assert gsm8k_score("72", "72", "strict") == 0.0
    assert gsm8k_score("72", "72", "flexible") == 1.0


def test_gsm8k_only_reads_the_end_of_long_responses() -> None:
    text = "#### 72\n" + "words " * 100
    assert gsm8k_score(text, "72") == 0.0
    assert gsm8k_score("words " * 1000 + "#### 72", "72") == 1.0


def test_gsm8k_rejects_unknown_modes() -> None:
    with pytest.raises(ValueError, match="strict"):
        extract_answer("#### 1", "loose")  # type: ignore[arg-type]


# -- DAPO --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("$\\boxed{1,000}$.", "1000"),
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("x = 5", "5"),
        ("12 \\text{ cm}", "12"),
        ("30^\\circ", "30"),
        ("7.0", "7"),
        ("\\text{(B)}", "(B)"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces: unwrapped whole
        ("$\\boxed{2^{10}}$", "2^{10}"),
        ("\\boxed{\\text{12 hours}}", "12"),
        ("\\boxed{3", "\\boxed{3"),  # unbalanced: left as it is
    ],
)
def test_dapo_normalisation(raw: str, canonical: str) -> None:
    assert normalize_answer(raw) == canonical


def test_dapo_scores_plus_and_minus_one() -> None:
    right = dapo_score("Let me think...\nAnswer: $\\boxed{1,000}$", "1000")
    assert (right.score, right.correct, right.pred) == (1.0, True, "1000")
    wrong = dapo_score("Answer: 999", "1000")
    assert (wrong.score, wrong.correct) == (-1.0, False)
    missing = dapo_score("The result is 1000", "1000")
    assert (missing.score, missing.pred) == (-1.0, None)
    assert dapo_score("answer: 3\nANSWER : 4", "4").correct  # the last one counts


# -- math-verify -----------------------------------------------------------------------


def test_math_verify_in_worker_does_not_block_the_loop_and_works_off_the_main_thread() -> None:
    async def check() -> tuple[list[Any], float]:
        gaps: list[float] = []
        stop = asyncio.Event()

        async def heartbeat() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.02)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        async with MathVerifier(workers=2, timeout_s=5) as verifier, asyncio.TaskGroup() as tg:
            tg.create_task(heartbeat())
            verdicts = await asyncio.gather(
                verifier.verify("\\frac{1}{2}", "so the answer is $\\boxed{0.5}$"),
                verifier.verify("2", "The final answer is $\\boxed{3}$"),
                verifier.verify("x^2+2x+1", "$\\boxed{(x+1)^2}$"),
            )
            stop.set()
        return [v.correct for v in verdicts], max(gaps)

    out: dict[str, Any] = {}

    def in_thread() -> None:  # an event loop that is not on the main thread
        out["result"] = asyncio.run(check())

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join(100)
    correct, max_gap = out["result"]
    assert correct == [True, False, True]
    assert max_gap < 0.5, f"the event loop was blocked for {max_gap:.2f} s"


def test_math_verify_worker_that_hangs_is_killed_and_replaced() -> None:
    async def main() -> tuple[Any, Any, int, float]:
        async with MathVerifier(
            workers=1, timeout_s=1, hard_timeout_s=0.3, worker_command=STUCK_WORKER
        ) as verifier:
            started = time.monotonic()
            first = await verifier.verify("1", "1")
            elapsed = time.monotonic() - started
            second = await verifier.verify("1", "1")
            return first, second, verifier.started_workers, elapsed

    first, second, workers, elapsed = asyncio.run(main())
    assert first.timed_out and not first.correct
    assert second.timed_out
    assert workers == 2  # the stuck one was killed, a fresh one took its slot
    assert elapsed < 10  # a worker's start and the hard time-out, not the stuck 3600 s


def test_math_verify_cancel_mid_answer_kills_the_worker() -> None:
    async def main() -> int:
        verifier = MathVerifier(workers=1, timeout_s=30, worker_command=STUCK_WORKER)
        task = asyncio.create_task(verifier.verify("1", "1"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        alive = len(verifier._all)
        await verifier.aclose()
        return alive

    assert asyncio.run(main()) == 0


# -- registry ----------------------------------------------------------------------------


def test_registry_resolves_names_data_sources_and_prefixes() -> None:
    reg = default_registry()
    assert reg.resolve(data_source="openai/gsm8k")[0] == "gsm8k"
    assert reg.resolve(data_source="math_dapo")[0] == "dapo"
    assert reg.resolve(data_source="aime2024")[0] == "dapo"
    assert reg.resolve(data_source="HuggingFaceH4/MATH-500")[0] == "math"
    assert reg.resolve("gsm8k_flexible", data_source="openai/gsm8k")[0] == "gsm8k_flexible"
    with pytest.raises(
        RewardError,
        match=r"no reward function for data_source 'unknown/set'; known rewards: arith, dapo, gsm8k",
    ):
        reg.resolve(data_source="unknown/set")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("gsm8k", lambda inp: RewardOutput(0.0))


def test_registry_scores_gsm8k_and_dapo() -> None:
    async def main() -> list[RewardOutput]:
        reg = default_registry()
        try:
            return [
                await reg.score(RewardInput("#### 72", "72", "openai/gsm8k")),
                await reg.score(RewardInput("Answer: 5", "5", "math_dapo")),
                await reg.score(RewardInput("72", "72", "openai/gsm8k"), name="gsm8k_flexible"),
            ]
        finally:
            await reg.aclose()

    g, d, f = asyncio.run(main())
    assert (g.score, g.metrics["acc"], g.pred) == (1.0, 1.0, "72")
    assert (d.score, d.pred) == (1.0, "5")
    assert f.score == 1.0


def _boom(inp: RewardInput) -> RewardOutput:
    raise ZeroDivisionError("bad ground truth")


def test_a_raising_reward_function_raises_reward_error_not_zero() -> None:
    reg = RewardRegistry()
    reg.register("boom", _boom, data_sources=("x",))
    with pytest.raises(
        RewardError,
        match=r"reward 'boom' failed on data_source 'x': ZeroDivisionError: bad ground truth",
    ) as info:
        asyncio.run(reg.score(RewardInput("a", "b", "x")))
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def _scored_sample(**data: Any) -> Sample:
    sample = Sample(index=3, data=data)
    sample.messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "thinking"},
        {"role": "tool", "content": "#### 1"},
        {"role": "assistant", "content": "#### 72"},
    ]
    return sample


def test_sample_reward_fn_reads_verl_columns_and_fills_reward_info() -> None:
    reg = default_registry()
    fn = sample_reward_fn(reg)
    sample = _scored_sample(
        data_source="openai/gsm8k", reward_model={"style": "rule", "ground_truth": "72"}
    )
    assert asyncio.run(fn(sample, {"calc_gsm8k_reward": 1.0})) == 1.0
    assert sample.reward_info["acc"] == 1.0


def test_sample_without_ground_truth_is_an_error() -> None:
    fn = sample_reward_fn(default_registry())
    with pytest.raises(RewardError, match=r"sample 3: no reward_model\.ground_truth"):
        asyncio.run(fn(_scored_sample(data_source="openai/gsm8k"), {}))


# -- the synthetic arithmetic task ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "pred"),
    [
        ("First add 7.\n<tool_call>...</tool_call>\n#### 19", 19),
        ("#### 19.", 19),
        ("####19", 19),
        ("#### -4", -4),
        ("#### 3 and later #### 5", 5),
        ("#### 1,234", None),  # not an integer literal
        ("#### 12.5", None),
        ("#### x", None),
        ("####", None),
        ("the answer is 19", None),
    ],
)
def test_arith_reads_the_integer_after_the_last_marker(text: str, pred: int | None) -> None:
    assert extract_integer(text) == pred


def test_arith_format_rule() -> None:
    assert arith_score("#### 19", "19").score == 1.0
    assert arith_score("#### 019", "19").correct  # compared as integers
    wrong = arith_score("#### 18", "19", format_score=0.1)
    assert (wrong.score, wrong.well_formed, wrong.correct, wrong.pred) == (0.1, True, False, 18)
    assert arith_score("#### 18", "19").score == 0.0  # format_score defaults to 0
    missing = arith_score("19", "19", format_score=0.1)
    assert (missing.score, missing.well_formed) == (0.0, False)
    assert arith_score("#### 19.0", "19", format_score=0.1).score == 0.0  # malformed
    with pytest.raises(ValueError, match=r"ground truth '1\.5' is not an integer"):
        arith_score("#### 1", "1.5")


def test_registry_resolves_the_arith_data_source() -> None:
    reg = default_registry()
    assert reg.resolve(data_source=arith.DATA_SOURCE)[0] == "arith"

    async def main() -> list[RewardOutput]:
        return [
            await reg.score(RewardInput("First.\n#### 42", "42", arith.DATA_SOURCE)),
            await reg.score(RewardInput("#### 41", "42", arith.DATA_SOURCE)),
            await reg.score(RewardInput("no answer", "42", arith.DATA_SOURCE)),
        ]

    right, wrong, none = asyncio.run(main())
    assert (right.score, right.metrics, right.pred) == (1.0, {"acc": 1.0, "format": 1.0}, "42")
    assert (wrong.score, wrong.metrics, wrong.pred) == (0.0, {"acc": 0.0, "format": 1.0}, "41")
    assert (none.score, none.metrics, none.pred) == (0.0, {"acc": 0.0, "format": 0.0}, None)
    with pytest.raises(RewardError, match=r"reward 'arith' failed on data_source 'tailcut/arith'"):
        asyncio.run(reg.score(RewardInput("#### 1", "one", arith.DATA_SOURCE)))


def test_arith_format_score_is_configurable() -> None:
    reg = default_registry(arith_format_score=0.25)
    out = asyncio.run(reg.score(RewardInput("#### 41", "42", arith.DATA_SOURCE)))
    assert out.score == 0.25


def test_a_currency_ground_truth_is_read_as_a_number() -> None:
    """MATH answers escape their dollar sign (``\\$18.90``): a currency sign, not a math
    delimiter — the ground truth is boxed and parsed, and a right answer scores."""

    async def check() -> list[Any]:
        async with MathVerifier(workers=1, timeout_s=5) as verifier:
            return list(
                await asyncio.gather(
                    verifier.verify("\\$18.90", "The answer is $\\boxed{18.90}$"),
                    verifier.verify("\\$18.90", "The answer is $\\boxed{19}$"),
                )
            )

    right, wrong = asyncio.run(check())
    assert right.correct and not wrong.correct


def test_a_very_long_answer_is_judged_wrong_not_failed() -> None:
    long = "\\boxed{\\text{" + "x" * 70_000 + "}}"  # its parse is echoed back: one long line

    async def check() -> Any:
        async with MathVerifier(workers=1, timeout_s=5) as verifier:
            return await verifier.verify("1", long)

    verdict = asyncio.run(check())
    assert not verdict.correct and verdict.pred is not None and len(verdict.pred) <= 1000


def test_the_math_worker_ignores_the_working_directory_and_says_why_it_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tailcut.reward.math import WORKER_COMMAND, MathVerifyError

    (tmp_path / "sympy.py").write_text("raise SystemExit('a sympy.py in the working directory')\n")
    monkeypatch.chdir(tmp_path)

    async def check(command: list[str]) -> Any:
        async with MathVerifier(workers=1, timeout_s=5, worker_command=command) as verifier:
            return await verifier.verify("1", "\\boxed{1}")

    assert asyncio.run(check(list(WORKER_COMMAND))).correct  # the real sympy, not this one
    broken = [sys.executable, "-c", "import sys; sys.exit('math_verify is not installed')"]
    with pytest.raises(MathVerifyError, match=r"exited \(code 1\): math_verify is not installed"):
        asyncio.run(check(broken))
