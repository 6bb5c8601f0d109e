"""Worker recipes: picklable builders of a worker's engine and rollout fn."""

from __future__ import annotations

from dataclasses import dataclass, field

from tailcut.config import SimEngineConfig
from tailcut.engine.base import Engine
from tailcut.engine.sim import SimEngine, SimFaults
from tailcut.rollout.scripted import ScriptedRollout
from tailcut.rollout.step import RolloutFn


@dataclass(frozen=True)
class SimRecipe:
    """A simulated engine playing workload trajectories (``sample.data["trajectory"]``)."""

    engine: SimEngineConfig = field(default_factory=SimEngineConfig)
    faults: dict[int, SimFaults] = field(default_factory=dict)
    """Faults to inject per worker rank."""

    async def build(self, rank: int) -> tuple[Engine, RolloutFn]:
        return SimEngine(self.engine, self.faults.get(rank)), ScriptedRollout()
