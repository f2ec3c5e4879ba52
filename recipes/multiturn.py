"""Multi-turn recipes: a guessing game and tool-use arithmetic, tiny Qwen3 from scratch.

Each starts with a short supervised warm-up on demonstrated episodes (temper/rl/warmup.py,
`run_demonstrations`), then GRPO on whole episodes: the env's observation tokens carry no loss,
every action token of an episode gets the episode's group-relative advantage. The guessing
game's warm-up mostly demonstrates a slower search than binary search, so what GRPO adds is
measurable: picking the strategy that finds the number within the turn limit (docs/rl.md).
Both decode turn by turn (`turn_batching="by_turn"`), so a run is reproducible and resumes
bitwise.
"""

from __future__ import annotations

import dataclasses

from temper.config.recipes import recipe
from temper.job import ModelChoice
from temper.rl.envs import GuessNumber, ToolArithmetic
from temper.rl.episodes import EpisodeRunner
from temper.rl.job import RLJob
from temper.rl.steps import RLSteps
from temper.rl.warmup import SFTWarmup
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine
from temper.trainer import TrainerEngine


def _multiturn(*, rl: RLSteps.Config, **fields) -> RLJob.Config:
    return RLJob.Config(
        model=ModelChoice.Config(base_model="tiny"),
        rl=dataclasses.replace(rl, prompts_per_step=16, group_size=8),
        sampler=SamplerEngine.Config(
            max_batch=256, max_seq_len=64, cpu=CpuDecoding.Config(num_threads=1)
        ),
        trainer=TrainerEngine.Config(shard_threads=2),
        **fields,
    )


@recipe("Guessing game (higher/lower) in 1..127: SFT on mostly slow search, GRPO finds binary")
def guess_number() -> RLJob.Config:
    # 127 = 2**7 - 1: binary search finds every number in 7 guesses, the turn limit. The
    # warm-up mostly demonstrates a slower search (guess at the first quarter), which finds
    # only about half of the secrets in 7 guesses; RL must pick binary search out of the two.
    return _multiturn(
        env=GuessNumber.Config(
            low=1,
            high=127,
            heldout_percent=30,
            heldout_secrets="on_search_paths",
            binary_demonstrations=0.3,
        ),
        episodes=EpisodeRunner.Config(max_turns=7, max_context=64, turn_batching="by_turn"),
        warmup=SFTWarmup.Config(steps=250, batch_size=32, learning_rate=2e-3, eval_every=0),
        rl=RLSteps.Config(
            steps=40, max_tokens=4, learning_rate=2e-4, lr_schedule="cosine", eval_every=20
        ),
        eval_problems=256,
    )


@recipe("Tool-use arithmetic: sums of three numbers with a calculator tool, SFT then GRPO (~1 min)")
def tool_arithmetic() -> RLJob.Config:
    return _multiturn(
        env=ToolArithmetic.Config(num_terms=3, min_digits=2, max_digits=2),
        episodes=EpisodeRunner.Config(max_turns=3, max_context=64, turn_batching="by_turn"),
        warmup=SFTWarmup.Config(steps=300, batch_size=32, learning_rate=2e-3, eval_every=0),
        rl=RLSteps.Config(steps=20, max_tokens=12, learning_rate=3e-4, eval_every=10),
        eval_problems=64,
    )
