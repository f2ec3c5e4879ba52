"""Environments: what an RL loop rolls out against.

An `Env` gives an initial observation (prompt tokens) and a stop condition, and turns the
policy's action tokens into a reward; `done=False` with a next observation makes it multi-turn.
Rewards live here, never in the sampler or trainer. `ProblemEnv` adapts a single-turn task
(problem -> answer checker) to this protocol, and `make_groups` builds the `group_size` copies
of each problem that GRPO compares.

Multi-turn: an `EnvSource` makes groups of episodes that start alike (episodes.py runs them),
fixed held-out environments, and demonstrations for the supervised warm-up. Everything is
tokens: the episode runner appends the exact sampled tokens and the observation tokens a step
returns to the context; nothing is re-tokenized from text.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from temper.tasks.problem import Problem, Task, scored
from temper.tokenizer import Tokenizer


@dataclass(frozen=True)
class StepResult:
    reward: float
    """This turn's reward; an episode's reward is the sum over its turns."""
    done: bool
    """The episode ended (its last observation, if any, is not appended)."""
    next_observation: list[int] | None = None
    """Tokens appended to the context after the action (multi-turn; zero loss weight)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers summed over an episode's turns (`correct`, `tool_calls`, `tool_failures`...)."""
    end_reason: str | None = None
    """Why the env ended the episode (with `done`); None reads as "done"."""


class Env(Protocol):
    def initial_observation(self) -> list[int]: ...

    def stop_token_ids(self) -> list[int]: ...

    def step(self, action_tokens: Sequence[int]) -> StepResult: ...


@dataclass(frozen=True)
class Demonstration:
    """A whole episode as one token sequence, with loss weight 1 on the policy's tokens."""

    tokens: list[int]
    weights: list[float]
    """Loss weight of predicting each token (0 on the first, the prompt and observations)."""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.weights):
            raise ValueError(
                f"Demonstration: {len(self.tokens)} tokens but {len(self.weights)} weights"
            )


class EnvSource(Protocol):
    """Where multi-turn episodes come from (a built-in one lives in temper/rl/envs/)."""

    def make_group(self, rng: random.Random, *, split: str, group_size: int) -> list[Env]:
        """`group_size` fresh environments in the same starting state, drawn from `split`."""
        ...

    def heldout_envs(self, count: int) -> list[Env]:
        """A fixed set of held-out environments (independent of the run's seed), made anew for
        every evaluation: each one plays one episode."""
        ...

    def demonstration(self, rng: random.Random) -> Demonstration:
        """A good episode on a training environment, for the supervised warm-up."""
        ...


class ProblemEnv:
    """One problem, one answer: reward from the task's checker on the decoded completion."""

    def __init__(self, problem: Problem, *, task: Task, tokenizer: Tokenizer) -> None:
        self.problem = problem
        self.task = task
        self.tokenizer = tokenizer

    def initial_observation(self) -> list[int]:
        return self.tokenizer.encode(self.problem.prompt)

    def stop_token_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id]

    def step(self, action_tokens: Sequence[int]) -> StepResult:
        text = self.tokenizer.decode(action_tokens, skip_special_tokens=True)
        reward = scored(self.task, self.problem, text)
        stopped = bool(action_tokens) and action_tokens[-1] == self.tokenizer.eos_token_id
        return StepResult(
            reward=reward, done=True, metrics={"correct": reward, "stopped": float(stopped)}
        )


def make_groups(
    task: Task,
    *,
    tokenizer: Tokenizer,
    rng: random.Random,
    num_groups: int,
    group_size: int,
    split: str,
) -> list[list[ProblemEnv]]:
    """`num_groups` problems, each repeated `group_size` times."""
    groups = []
    for _ in range(num_groups):
        problem = task.sample(rng, split=split)
        groups.append(
            [ProblemEnv(problem, task=task, tokenizer=tokenizer) for _ in range(group_size)]
        )
    return groups
