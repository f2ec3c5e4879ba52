"""Held-out accuracy: greedy answers from a sampling client, scored by the task."""

from __future__ import annotations

import random

from temper.api.types import SamplingParams
from temper.rl.env import ProblemEnv, Task
from temper.rl.rollout import rollout_groups
from temper.rl.tasks.sum_digits import Problem


def heldout_problems(task: Task, *, count: int) -> list[Problem]:
    """A fixed set (independent of the run's seed), so every evaluation scores the same."""
    return [task.sample(random.Random(f"heldout-{i}"), split="heldout") for i in range(count)]


def greedy_accuracy(
    sampling_client, problems: list[Problem], *, task: Task, tokenizer, max_tokens: int
) -> tuple[float, list[tuple[str, str, float]]]:
    """Accuracy and (prompt, completion, reward) of each problem."""
    groups = [[ProblemEnv(p, task=task, tokenizer=tokenizer)] for p in problems]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    trajectories = [group[0] for group in rollout_groups(sampling_client, groups, params=params)]
    examples = [
        (p.prompt, tokenizer.decode(t.completion, skip_special_tokens=True), t.reward)
        for p, t in zip(problems, trajectories, strict=True)
    ]
    return sum(t.reward for t in trajectories) / len(trajectories), examples
