"""sum_digits_inflight: sum_digits with PipelineRL-style asynchronous RL on in-flight weights.

The asynchronous loop (`mode="inflight"`, temper/rl/loops.py) samples up to `max_staleness`
batches ahead of the trainer on the training client's in-flight sampling target; every
optimizer step's save moves that target on, so episodes still decoding finish on the newest
weights (their tokens before the update keep the logprobs of the weights that drew them). The
same PPO-clipped importance ratio as `mode="async"` corrects what lag is left.
"""

from __future__ import annotations

from recipes.sum_digits import sum_digits_short_warmup
from temper.config.recipes import recipe
from temper.rl.job import RLJob


@recipe("A short warm-up, then asynchronous GRPO on in-flight weights (~1 min on CPU)")
def sum_digits_inflight() -> RLJob.Config:
    """`sum_digits_short_warmup`'s run (a warm-up far below what RL reaches, then GRPO at a
    modest decaying rate), shortened, with batches sampled up to two steps ahead."""
    config = sum_digits_short_warmup()
    config.rl.steps = 40
    config.rl.eval_every = 40
    config.mode = "inflight"
    config.max_staleness = 2
    return config
