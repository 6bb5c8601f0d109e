"""Resuming a cut-off trajectory (``cutoff.aborted=partial``) where it stopped.

A resumed sample (``rollout/partial.py``) still holds its tokens, masks, log-probs, versions,
turns and messages. Where the cut found it decides how it goes on:

* **inside a generation** (last message: a partial assistant message, last turn finished
  ``abort``): the engine is asked to continue from *prompt + tokens so far*; the new tokens
  are appended, and the assistant message is the old part plus the new part;
* **inside tool calls** (last message: a complete assistant message, last turn finished
  ``stop``): the tool calls of that message are parsed and run again, then the loop goes on;
* **between turns** (last message: tool output, its tokens already appended): the next turn
  starts as usual.

The open turn stays one turn: its record is reused (a new request id for the new engine call)
and its generation continues with what ``max_new_tokens`` left it and the same seed stream
(``SamplingParams.seed_offset``), so a cut + resumed trajectory obeys every cap an uncut one
obeys, and on an engine that can continue a stream samples the tokens the uncut one would.

The conversation state is rebuilt from the messages (the template renders them the same
way), never from a re-tokenization of the tokens: the tokens stay the ones the policy
sampled. Tools start a fresh session: a stateful tool forgets calls made before the cut.
"""

from __future__ import annotations

from typing import Any

from tailcut.chat.tokenize import IncrementalChat
from tailcut.engine.base import Engine
from tailcut.rollout.agent_loop import (
    AgentLoop,
    _Trajectory,
    finish_reason_on_error,
    tool_create_kwargs,
)
from tailcut.trace.events import Tracer
from tailcut.types import FinishReason, GenerateResult, Sample, Turn, new_request_id


def open_assistant_ids(sample: Sample) -> list[int]:
    """The sampled tokens after the last forced token: the open assistant message."""
    n = len(sample.loss_mask)
    start = n
    while start > 0 and sample.loss_mask[start - 1] == 1:
        start -= 1
    return list(sample.response_ids[start:])


class _Resumed(_Trajectory):
    """A trajectory picked up mid-way: the first turn replays or continues ``prior``."""

    def __init__(
        self, *args: Any, prior: list[int] | None, continue_generation: bool, first: int
    ) -> None:
        super().__init__(*args)
        self.prior = prior
        self.continue_generation = continue_generation
        self.first = first

    def _continues(self, index: int) -> bool:
        turns = self.sample.turns
        return self.prior is not None and bool(turns) and turns[-1].index == index

    def _open_turn(self, index: int) -> Turn:
        if not self._continues(index):
            return super()._open_turn(index)
        turns = self.sample.turns
        turn = turns[-1]  # the turn the cut left open goes on
        if self.continue_generation:  # a new engine call (a replay sends none)
            turn.request_id = new_request_id()
        turn.output_tokens = len(self.prior or ())
        return turn

    async def turns(self) -> FinishReason:
        for index in range(self.first, self.cfg.max_turns):
            reason = await self._turn(index)
            if reason is not None:
                return reason
        return FinishReason.MAX_TURNS

    async def _generate(self, turn: Turn, budget: int) -> GenerateResult:
        if self.prior is None:
            return await super()._generate(turn, budget)
        prior, self.prior = self.prior, None
        if not self.continue_generation:
            # The generation had finished; only its tool calls were cut: replay it.
            turn.finish_reason = FinishReason.STOP
            return GenerateResult(turn.request_id, prior, FinishReason.STOP, [])
        result = await super()._generate(turn, budget)
        return GenerateResult(
            result.request_id,
            prior + list(result.output_ids),
            result.finish_reason,
            None,
            result.weight_version,
            result.prompt_tokens,
            result.error,
        )


class ResumableAgentLoop(AgentLoop):
    """The agent loop, able to carry on a trajectory a previous step cut off."""

    async def __call__(self, sample: Sample, engine: Engine, tracer: Tracer) -> None:
        if not (sample.response_ids or sample.turns):
            await super().__call__(sample, engine, tracer)
            return
        with finish_reason_on_error(sample):
            await self._resume(sample, engine, tracer)

    async def _resume(self, sample: Sample, engine: Engine, tracer: Tracer) -> None:
        if not sample.messages:
            raise ValueError(f"sample {sample.index}: has tokens but no messages to resume from")
        last = sample.messages[-1]
        open_turn = last.get("role") == "assistant"
        base = sample.messages[:-1] if open_turn else sample.messages
        prior = open_assistant_ids(sample) if open_turn else None
        last_turn = sample.turns[-1] if sample.turns else None
        # an abort that raced the end of a generation can carry its stop token: it ended
        ended = prior is not None and len(prior) > 0 and prior[-1] in self.stop_ids
        continue_generation = not ended and (
            last_turn is None or last_turn.finish_reason is not FinishReason.STOP
        )
        first = (last_turn.index + (0 if open_turn else 1)) if last_turn is not None else 0
        chat = IncrementalChat(
            self.tokenizer,
            base,
            self.schemas,
            stop_ids=self.stop_ids,
            template_kwargs=self.template_kwargs,
            parser=self.parser,
        )
        sample.messages = chat.messages
        instance_id = f"{sample.workid}-r{sample.resumed_from_step or 0}"
        async with self.toolset.session(instance_id, tool_create_kwargs(sample.data)) as session:
            run = _Resumed(
                self, sample, engine, tracer, chat, session,
                prior=prior, continue_generation=continue_generation, first=first,
            )  # fmt: skip
            sample.finish_reason = await run.turns()
            if sample.finish_reason is not FinishReason.ABORT:
                await self._score_whole(sample, session)
