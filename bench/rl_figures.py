"""Figures of one RL run's metrics shared by the RL benchmarks (routing_replay.py,
support_mismatch.py): time per RL step, reward over the first and last tenth of the RL steps,
and the mean and max of chosen metrics."""

from __future__ import annotations

from collections.abc import Sequence


def rl_figures(rl: Sequence[dict], *, means: Sequence[str]) -> dict:
    """`rl`: the metrics records of the RL steps (those with `reward/mean`)."""
    tenth = max(1, len(rl) // 10)
    figures: dict = {
        "rl_seconds_per_step": round(
            sum(r["time/sample"] + r["time/train"] for r in rl) / len(rl), 4
        ),
        "reward_first": sum(r["reward/mean"] for r in rl[:tenth]) / tenth,
        "reward_last": sum(r["reward/mean"] for r in rl[-tenth:]) / tenth,
    }
    for name in means:
        values = [r[name] for r in rl if name in r]
        if values:
            figures[f"{name}:mean"] = sum(values) / len(values)
            figures[f"{name}:max"] = max(values)
    return figures
