"""Environments: what an RL loop rolls out against.

An `Env` gives an initial observation (prompt tokens) and a stop condition, and turns the
policy's action tokens into a reward; `done=False` with a next observation makes it multi-turn.
Rewards live here, never in the sampler or trainer. `ProblemEnv` adapts a single-turn task
(problem -> answer checker) to this protocol, and `make_groups` builds the `group_size` copies
of each problem that GRPO compares.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from temper.tasks.problem import Problem, Task
from temper.tokenizer import Tokenizer


@dataclass(frozen=True)
class StepResult:
    reward: float
    done: bool
    next_observation: list[int] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Env(Protocol):
    def initial_observation(self) -> list[int]: ...

    def stop_token_ids(self) -> list[int]: ...

    def step(self, action_tokens: Sequence[int]) -> StepResult: ...


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
        reward = self.task.reward(self.problem, text)
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
