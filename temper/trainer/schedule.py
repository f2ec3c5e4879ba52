"""Learning-rate schedules (factors of a peak rate)."""

from __future__ import annotations

import math


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, floor: float = 0.1) -> float:
    """Linear warm-up to 1 over `warmup_steps`, then cosine decay to `floor` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
