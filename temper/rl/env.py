"""Environments: what an RL loop rolls out against.

An `Env` gives an initial observation (prompt tokens) and a stop condition, and turns the
policy's action tokens into a reward; `done=False` with a next observation makes it multi-turn.
Rewards live here, never in the sampler or trainer.

An `EnvSource` makes groups of episodes that start alike (episodes.py runs them), fixed
held-out environments, and demonstrations for the supervised warm-up; the RL job rolls out,
evaluates and warms up through one. `ProblemSource` is the source of a single-turn task
(problem -> answer checker): its `ProblemEnv`s are one-turn episodes. Everything is tokens: the
episode runner appends the exact sampled tokens and the observation tokens a step returns to
the context; nothing is re-tokenized from text.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from temper.tasks.evaluation import heldout_problems
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


Turns = Literal["single", "multi"]
"""How many actions a source's episodes take, and so how the episode runner samples them.
'single': one action each (a problem and its answer); a group's actions are one sample request
of `group_size` completions of its shared prompt (one prefill), seeded with the group's seed.
'multi': each episode samples its turns on a seed stream of its own (drawn from the group's
seed), turn after turn until its env says done."""


class EnvSource(Protocol):
    """Where episodes come from: `ProblemSource` below, or a multi-turn source (the built-in
    ones live in temper/rl/envs/)."""

    turns: Turns

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
    """One problem, one answer: reward from the task's checker on the decoded completion (the
    episode ends after that one action)."""

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


class ProblemSource:
    """A single-turn task as an `EnvSource`: a group is `group_size` copies of one problem, the
    held-out environments are the task's fixed held-out problems, and a demonstration is a
    problem with its reference answer (and EOS)."""

    turns: Turns = "single"

    def __init__(self, task: Task, *, tokenizer: Tokenizer) -> None:
        self.task, self.tokenizer = task, tokenizer
        self._heldout: list[Problem] = []
        """The first held-out problems, drawn once (they do not depend on the run)."""

    def make_group(self, rng: random.Random, *, split: str, group_size: int) -> list[ProblemEnv]:
        problem = self.task.sample(rng, split=split)
        return [self._env(problem) for _ in range(group_size)]

    def heldout_envs(self, count: int) -> list[ProblemEnv]:
        if len(self._heldout) < count:
            self._heldout = heldout_problems(self.task, count=count)
        return [self._env(problem) for problem in self._heldout[:count]]

    def demonstration(self, rng: random.Random) -> Demonstration:
        """A training problem and its answer, with loss weight on the answer's tokens."""
        problem = self.task.sample(rng, split="train")
        prompt = self.tokenizer.encode(problem.prompt)
        answer = [*self.tokenizer.encode(problem.answer), self.tokenizer.eos_token_id]
        return Demonstration(
            tokens=prompt + answer, weights=[0.0] * len(prompt) + [1.0] * len(answer)
        )

    def _env(self, problem: Problem) -> ProblemEnv:
        return ProblemEnv(problem, task=self.task, tokenizer=self.tokenizer)
