"""reverse_text: a randomly initialized tiny Qwen3 learns to write short strings backwards.

The "letters" vocabulary (one token per character) makes reversal a pure copying-in-reverse
problem. Supervised warm-up first, then GRPO; answers are up to 5 letters plus the stop token.
"""

from __future__ import annotations

from temper.config.recipes import recipe
from temper.rl.loop_sync import RLJob
from temper.rl.tasks import ReverseText
from temper.rl.warmup import SFTWarmup


@recipe("SFT warm-up then GRPO on reversing 3-5 letter strings, tiny Qwen3 (CPU, minutes)")
def reverse_text() -> RLJob.Config:
    return RLJob.Config(
        base_model="tiny:letters",
        task=ReverseText.Config(alphabet="abcdefghijklmnop", min_length=3, max_length=5),
        warmup=SFTWarmup.Config(steps=600, batch_size=64, learning_rate=2e-3),
        steps=100,
        prompts_per_step=32,
        group_size=8,
        max_tokens=6,
        learning_rate=3e-5,
        eval_every=25,
    )
