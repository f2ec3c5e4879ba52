"""sum_digits: teach a randomly initialized tiny Qwen3 to add up the digits of a number.

Until the RL loop lands this is a supervised run; it becomes the SFT warm-up stage of the
GRPO recipe.
"""

from __future__ import annotations

from temper.config.recipes import recipe
from temper.sft import SFTJob


@recipe(
    "SFT a random tiny Qwen3 on sum-of-digits; held-out accuracy on CPU in ~2 min", default=True
)
def sum_digits() -> SFTJob.Config:
    return SFTJob.Config(steps=1200, batch_size=64, learning_rate=2e-3, eval_every=100)


@recipe("A 60-step sum_digits run for smoke tests (seconds on CPU)")
def sum_digits_smoke() -> SFTJob.Config:
    config = sum_digits()
    config.steps = 60
    config.eval_every = 30
    config.eval_problems = 64
    return config
