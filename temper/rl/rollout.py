"""Rollouts through a sampling client, and the Datums that train on them.

Shapes: P prompt tokens, C completion tokens; a datum has P + C - 1 positions.

All groups of a step are submitted before any result is read, so the sampler decodes them as
one batch. A datum's loss inputs cover every position; prompt positions get advantage 0 and
logprob 0, so they contribute nothing to the importance-sampling and PPO losses.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

from temper.api.types import Datum, ModelInput, SamplingParams
from temper.rl.env import ProblemEnv


@dataclass(frozen=True)
class Trajectory:
    prompt: list[int]
    completion: list[int]
    sampler_logprobs: list[float]
    reward: float
    stop_reason: str
    metrics: dict[str, float]


def rollout_groups(
    sampling_client,
    groups: Sequence[Sequence[ProblemEnv]],
    *,
    params: SamplingParams,
    rng: random.Random | None = None,
) -> list[list[Trajectory]]:
    """Sample each group (one request of `len(group)` samples); with `rng`, every request
    gets a seed from it, so a seeded run reproduces its rollouts exactly."""
    futures = []
    for group in groups:
        request_params = params
        if rng is not None:
            request_params = dataclasses.replace(params, seed=rng.getrandbits(63))
        prompt = ModelInput.from_ints(group[0].initial_observation())
        futures.append(sampling_client.sample(prompt, len(group), request_params))
    results = []
    for group, future in zip(groups, futures, strict=True):
        response = future.result()
        trajectories = []
        for env, sequence in zip(group, response.sequences, strict=True):
            step = env.step(sequence.tokens)
            trajectories.append(
                Trajectory(
                    prompt=env.initial_observation(),
                    completion=list(sequence.tokens),
                    sampler_logprobs=list(sequence.logprobs),
                    reward=step.reward,
                    stop_reason=sequence.stop_reason,
                    metrics=step.metrics,
                )
            )
        results.append(trajectories)
    return results


def policy_datum(trajectory: Trajectory, *, advantage: float) -> Datum:
    """Inputs for `importance_sampling` / `ppo`: targets, sampler logprobs, advantages.

    The losses are sums over tokens; the caller folds any normalization into `advantage`."""
    tokens = trajectory.prompt + trajectory.completion
    num_prompt_targets = len(trajectory.prompt) - 1
    num_completion = len(trajectory.completion)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * num_prompt_targets + trajectory.sampler_logprobs,
            "advantages": [0.0] * num_prompt_targets + [advantage] * num_completion,
        },
    )


def supervised_datum(
    prompt: Sequence[int], completion: Sequence[int], *, weight: float = 1.0
) -> Datum:
    """Inputs for `cross_entropy` with `weight` on each completion token, 0 on the prompt."""
    tokens = [*prompt, *completion]
    weights = [0.0] * (len(prompt) - 1) + [weight] * len(completion)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )
