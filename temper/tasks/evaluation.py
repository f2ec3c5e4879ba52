"""Held-out accuracy: greedy answers from a sampling client, scored by the task.

Shared by the RL and SFT jobs. Every problem is sent before any answer is read, inside
`SamplingClient.batch()`, so the sampler decodes them as one batch whatever the timing (and a
resumed run's evaluations equal an uninterrupted one's).
"""

from __future__ import annotations

import random

from temper.api.types import ModelInput, SamplingParams
from temper.client.sampling_client import SamplingClient
from temper.tasks.problem import Problem, Task, scored
from temper.tokenizer import Tokenizer


def heldout_problems(task: Task, *, count: int) -> list[Problem]:
    """A fixed set (independent of the run's seed), so every evaluation scores the same."""
    return [task.sample(random.Random(f"heldout-{i}"), split="heldout") for i in range(count)]


def greedy_accuracy(
    sampling_client: SamplingClient,
    problems: list[Problem],
    *,
    task: Task,
    tokenizer: Tokenizer,
    max_tokens: int,
) -> tuple[float, list[tuple[str, str, float]]]:
    """Accuracy and (prompt, completion, reward) of each problem."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    with sampling_client.batch():
        futures = [
            sampling_client.sample(ModelInput.from_ints(tokenizer.encode(p.prompt)), 1, params)
            for p in problems
        ]
    examples = []
    for problem, future in zip(problems, futures, strict=True):
        completion_tokens = future.result().sequences[0].tokens
        completion = tokenizer.decode(completion_tokens, skip_special_tokens=True)
        examples.append((problem.prompt, completion, scored(task, problem, completion)))
    return sum(reward for _, _, reward in examples) / len(examples), examples
