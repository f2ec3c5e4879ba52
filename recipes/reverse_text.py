"""reverse_text: a randomly initialized tiny Qwen3 learns to write short strings backwards.

The "letters" vocabulary (one token per character) makes reversal copying in reverse order.
A short supervised warm-up gets the model part of the way, then GRPO lifts it: measured with
seed 0, held-out accuracy 0.70 after the warm-up and 0.75 after 100 GRPO steps (rollout reward
0.27 -> 0.40). A longer warm-up alone reaches ~1.0 (200 steps), which would leave RL nothing to
show. Answers are up to 8 letters plus the stop token.
"""

from __future__ import annotations

import string

from temper.config.recipes import recipe
from temper.job import ModelChoice
from temper.rl.job import RLJob
from temper.rl.steps import RLSteps
from temper.rl.warmup import SFTWarmup
from temper.tasks import ReverseText


@recipe("Short SFT warm-up then GRPO on reversing 4-8 letter strings, tiny Qwen3 (CPU, ~2 min)")
def reverse_text() -> RLJob.Config:
    return RLJob.Config(
        model=ModelChoice.Config(base_model="tiny:letters"),
        task=ReverseText.Config(alphabet=string.ascii_lowercase, min_length=4, max_length=8),
        warmup=SFTWarmup.Config(steps=110, batch_size=64, learning_rate=2e-3),
        rl=RLSteps.Config(
            steps=100,
            prompts_per_step=32,
            group_size=8,
            max_tokens=9,
            learning_rate=5e-5,
            eval_every=20,
        ),
    )
