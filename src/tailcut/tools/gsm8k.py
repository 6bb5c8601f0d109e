"""The ``calc_gsm8k_reward`` tool: the model submits an answer and reads its reward.

Observable behaviour of verl's GSM8K tool: the ``answer`` argument (made a string when
it is not one) gets the ``#### `` prefix when missing and is scored with the GSM8K
flexible rule against the sample's ``ground_truth`` (a ``create_kwargs`` entry); the
reply is ``Current parsed answer='…' reward=…``; a call that does not improve on the
best reward so far earns a step reward of −0.05. ``calc_reward`` gives the best reward
of the trajectory (``mode="best"``) or, as verl does, that of the last call
(``mode="last"``, where "improve" also means "better than the last call").
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tailcut.reward.gsm8k import gsm8k_score
from tailcut.tools.base import ToolResult

TOOL_NAME = "calc_gsm8k_reward"

SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, "
            "0.0 if parsed answer is incorrect or not correctly parsed)"
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "answer": {"type": "string", "description": "The model's answer to the GSM8K math problem, must be a digits"},
            },
            "required": ["answer"],
        },
    },
}  # fmt: skip


class Gsm8kToolConfig(BaseModel):
    """Options of the GSM8K reward tool (the ``config`` block of a tool-config entry)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["best", "last"] = "best"
    """Reward of the trajectory: best over its calls, or its last call's (verl)."""
    step_penalty: float = Field(-0.05, ge=-1.0, le=0.0)
    """Step reward of a call that does not improve the reward."""


@dataclass(slots=True)
class _State:
    ground_truth: str | None
    best: float = 0.0
    last: float = 0.0
    calls: int = 0


class Gsm8kTool:
    """Scores submitted GSM8K answers; one state per trajectory (``instance_id``)."""

    def __init__(self, config: Gsm8kToolConfig | None = None, schema: dict[str, Any] | None = None):
        self.config = config or Gsm8kToolConfig()
        self._schema = copy.deepcopy(schema or SCHEMA)
        self.name: str = self._schema["function"]["name"]
        self._states: dict[str, _State] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any], tool_schema: dict[str, Any] | None) -> Gsm8kTool:
        return cls(Gsm8kToolConfig.model_validate(config), tool_schema)

    def schema(self) -> dict[str, Any]:
        return self._schema

    @property
    def open_instances(self) -> int:
        return len(self._states)

    async def create(self, instance_id: str, ground_truth: Any = None, **_: Any) -> None:
        truth = None if ground_truth is None else str(ground_truth)
        self._states[instance_id] = _State(ground_truth=truth)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        state = self._states[instance_id]
        answer = arguments.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        response = answer if answer.startswith("#### ") else "#### " + answer
        truth = state.ground_truth
        reward = 0.0 if truth is None else gsm8k_score(response, truth, "flexible")
        before = state.best if self.config.mode == "best" else state.last
        step = 0.0 if reward > before else self.config.step_penalty
        state.best = max(state.best, reward)
        state.last = reward
        state.calls += 1
        return ToolResult(
            f"Current parsed answer={answer!r} reward={reward!r}",
            step_reward=step,
            metrics={"gsm8k_reward": reward},
        )

    async def calc_reward(self, instance_id: str) -> float:
        state = self._states[instance_id]
        return state.best if self.config.mode == "best" else state.last

    async def release(self, instance_id: str) -> None:
        self._states.pop(instance_id, None)
