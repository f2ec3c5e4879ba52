"""What an RL run carries besides weights and optimizer state: the loop's own state, saved
for a resume, and the run's result."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from temper.checkpoint.run_state import rng_from_json, rng_to_json


@dataclass(frozen=True)
class RLResult:
    warmup_accuracy: float | None
    final_accuracy: float
    reward_first: float
    reward_last: float
    sampler_path: str


@dataclass
class RLLoopState:
    """All a resume needs besides the weights and optimizer state: the run's RNG (problems
    and sample seeds) and what the final report shows. Saved as the run state's `loop`."""

    rng: random.Random
    rewards: list[float] = field(default_factory=list)
    """Mean rollout reward of each RL step done."""
    warmup_accuracy: float | None = None
    """Held-out accuracy after the warm-up (None without one)."""
    kl_reference: str | None = None
    """Sampler weights of the policy at the start of RL, the KL penalty's reference
    (kl_coef > 0); saved once, so a resumed run keeps the same reference."""

    def to_json(self) -> dict[str, Any]:
        return {
            "rewards": list(self.rewards),
            "warmup_accuracy": self.warmup_accuracy,
            "kl_reference": self.kl_reference,
            "rng": rng_to_json(self.rng),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RLLoopState:
        return cls(
            rng=rng_from_json(data["rng"]),
            rewards=list(data["rewards"]),
            warmup_accuracy=data.get("warmup_accuracy"),
            kl_reference=data.get("kl_reference"),
        )
