"""Group-relative advantages: GRPO, Dr.GRPO and RLOO.

Shapes: G group members.

- "grpo": (r - mean) / (std + eps), the GRPO paper's normalization;
- "dr_grpo": r - mean, without the std division (Dr.GRPO: the division biases toward
  questions whose rewards barely vary);
- "rloo": r_i - mean of the other members (leave-one-out baseline).
A group whose rewards are all equal carries no signal; with `drop_uniform` it is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

AdvantageMode = Literal["grpo", "dr_grpo", "rloo"]
_STD_EPS = 1e-6


def group_advantages(rewards: Sequence[float], *, mode: AdvantageMode) -> list[float]:
    if len(rewards) < 2:
        raise ValueError(f"a group needs at least 2 members for a baseline, got {len(rewards)}")
    rewards_G = torch.tensor(rewards, dtype=torch.float64)
    mean = rewards_G.mean()
    if mode == "grpo":
        advantages_G = (rewards_G - mean) / (rewards_G.std(correction=0) + _STD_EPS)
    elif mode == "dr_grpo":
        advantages_G = rewards_G - mean
    elif mode == "rloo":
        count = len(rewards)
        advantages_G = rewards_G - (rewards_G.sum() - rewards_G) / (count - 1)
    else:
        raise ValueError(f"advantage mode must be 'grpo', 'dr_grpo' or 'rloo', got {mode!r}")
    return advantages_G.tolist()


def is_uniform(rewards: Sequence[float]) -> bool:
    return max(rewards) == min(rewards)
