"""sum_digits: a randomly initialized tiny Qwen3 learns to add up the digits of a number.

The default run is an SFT warm-up (RL alone does not find the task from random weights) followed
by GRPO with PPO-clipped importance sampling, all through the Tinker-style client API.
"""

from __future__ import annotations

from temper.config.recipes import recipe
from temper.rl.job import RLJob
from temper.rl.steps import RLSteps
from temper.rl.warmup import SFTWarmup
from temper.sft import SFTJob
from temper.trainer import TrainerEngine


def cpu_trainer() -> TrainerEngine.Config:
    """For a tiny model on a CPU: its ops are too small to spread over cores, so the trainer
    runs each call as two concurrent single-threaded shards of the datums instead."""
    return TrainerEngine.Config(shard_threads=2)


@recipe(
    "SFT warm-up then GRPO on sum-of-digits, tiny Qwen3 from scratch (~1 min on CPU)", default=True
)
def sum_digits() -> RLJob.Config:
    return RLJob.Config(
        warmup=SFTWarmup.Config(steps=1000, batch_size=64, learning_rate=2e-3),
        rl=RLSteps.Config(
            steps=100, prompts_per_step=32, group_size=8, learning_rate=3e-5, eval_every=25
        ),
        trainer=cpu_trainer(),
    )


@recipe("GRPO does the learning: 150 warm-up steps (~0.33), then RL to ~0.9 (~4 min on CPU)")
def sum_digits_short_warmup() -> RLJob.Config:
    """What makes RL learn here (docs/rl.md, "RL that does the learning"): many steps at a
    modest rate that decays, not a high constant rate (2e-4 and up first unlearns)."""
    config = sum_digits()
    config.warmup.steps = 150
    config.rl.steps = 1500
    config.rl.learning_rate = 1e-4
    config.rl.lr_schedule = "cosine"
    config.rl.eval_every = 100
    return config


@recipe("Supervised only: SFT a random tiny Qwen3 on sum-of-digits (~1.5 min on CPU)")
def sum_digits_sft() -> SFTJob.Config:
    return SFTJob.Config(
        steps=1200, batch_size=64, learning_rate=2e-3, eval_every=100, trainer=cpu_trainer()
    )


@recipe("A 60-step supervised sum_digits run for smoke tests (seconds on CPU)")
def sum_digits_smoke() -> SFTJob.Config:
    config = sum_digits_sft()
    config.steps = 60
    config.eval_every = 30
    config.eval_problems = 64
    return config
