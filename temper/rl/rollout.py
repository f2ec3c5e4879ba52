"""Rollouts through a sampling client, and the Datums that train on them.

Shapes: P prompt tokens, C completion tokens; a datum has P + C - 1 positions.

A rollout is submitted, then collected: `submit_rollouts` draws every request's seed and sends
all groups of a step before any result is read, inside `SamplingClient.batch()`, so the sampler
decodes them as one batch whatever the timing (its logprobs depend on the batch at rounding
level, and a seeded or resumed run must reproduce them), and an asynchronous loop can go on
training meanwhile; `PendingRollouts.wait()` blocks for the
completions and `score_rollouts` asks the environments for rewards. A datum's loss inputs
cover every position; prompt positions get advantage 0 and logprob 0, so they contribute
nothing to the importance-sampling and PPO losses.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

from temper.api.futures import APIFuture
from temper.api.types import Datum, ModelInput, SampleResponse, SamplingParams
from temper.client.sampling_client import SamplingClient
from temper.rl.env import ProblemEnv


@dataclass(frozen=True)
class Trajectory:
    prompt: list[int]
    completion: list[int]
    sampler_logprobs: list[float]
    reward: float
    stop_reason: str
    metrics: dict[str, float]
    action_mask: list[float] | None = None
    """Multi-turn episodes: 1.0 on each completion token the policy sampled, 0.0 on the
    environment's observation tokens between turns (their `sampler_logprobs` are 0.0). None:
    every completion token was sampled (single-turn)."""

    @property
    def num_action_tokens(self) -> int:
        """Completion tokens the policy sampled (those the loss trains on)."""
        if self.action_mask is None:
            return len(self.completion)
        return sum(1 for weight in self.action_mask if weight)

    def action_values(self, values: Sequence[float]) -> list[float]:
        """The entries of a per-completion-token list at the sampled tokens."""
        if self.action_mask is None:
            return list(values)
        return [v for v, weight in zip(values, self.action_mask, strict=True) if weight]


@dataclass(frozen=True)
class PendingRollouts:
    """Sample requests in flight: one per group, answered by one sampling client."""

    groups: list[list[ProblemEnv]]
    futures: list[APIFuture[SampleResponse]]
    sampler_version: int
    """Policy version of the sampling client that answers them."""

    def wait(self) -> list[SampleResponse]:
        return [future.result() for future in self.futures]


def submit_rollouts(
    sampling_client: SamplingClient,
    groups: Sequence[Sequence[ProblemEnv]],
    *,
    params: SamplingParams,
    rng: random.Random | None = None,
    seeds: Sequence[int] | None = None,
) -> PendingRollouts:
    """Send one request of `len(group)` samples per group; with `rng`, every request gets a
    seed from it (drawn here, in order), so a seeded run reproduces its rollouts exactly; or
    give each group's seed in `seeds`."""
    if rng is not None and seeds is not None:
        raise ValueError("submit_rollouts takes rng or seeds, not both")
    if seeds is not None and len(seeds) != len(groups):
        raise ValueError(f"submit_rollouts: {len(seeds)} seeds for {len(groups)} groups")
    futures = []
    with sampling_client.batch():
        for index, group in enumerate(groups):
            request_params = params
            if rng is not None:
                request_params = dataclasses.replace(params, seed=rng.getrandbits(63))
            elif seeds is not None:
                request_params = dataclasses.replace(params, seed=seeds[index])
            prompt = ModelInput.from_ints(group[0].initial_observation())
            futures.append(sampling_client.sample(prompt, len(group), request_params))
    return PendingRollouts(
        groups=[list(group) for group in groups],
        futures=futures,
        sampler_version=sampling_client.version,
    )


def score_rollouts(
    groups: Sequence[Sequence[ProblemEnv]], responses: Sequence[SampleResponse]
) -> list[list[Trajectory]]:
    """Rewards from each group's environments for its sampled completions."""
    results = []
    for group, response in zip(groups, responses, strict=True):
        # The prompt every sample of the group was drawn from (submit_rollouts sends the first
        # environment's), tokenized once per group rather than once per sample.
        prompt = group[0].initial_observation()
        trajectories = []
        for env, sequence in zip(group, response.sequences, strict=True):
            step = env.step(sequence.tokens)
            trajectories.append(
                Trajectory(
                    prompt=list(prompt),
                    completion=list(sequence.tokens),
                    sampler_logprobs=list(sequence.logprobs),
                    reward=step.reward,
                    stop_reason=sequence.stop_reason,
                    metrics=step.metrics,
                )
            )
        results.append(trajectories)
    return results


def rollout_groups(
    sampling_client: SamplingClient,
    groups: Sequence[Sequence[ProblemEnv]],
    *,
    params: SamplingParams,
    rng: random.Random | None = None,
) -> list[list[Trajectory]]:
    """Submit, wait and score in one call."""
    pending = submit_rollouts(sampling_client, groups, params=params, rng=rng)
    return score_rollouts(pending.groups, pending.wait())


def policy_datum(trajectory: Trajectory, *, advantage: float | Sequence[float]) -> Datum:
    """Inputs for `importance_sampling` / `ppo`: targets, sampler logprobs, advantages.

    `advantage` is one number for every completion token, or one per completion token (e.g.
    with a per-token KL penalty). The losses are sums over tokens; the caller folds any
    normalization into `advantage`. Observation tokens of a multi-turn episode (its
    `action_mask` is 0 there) get advantage 0 and logprob 0, like prompt tokens."""
    tokens = trajectory.prompt + trajectory.completion
    num_prompt_targets = len(trajectory.prompt) - 1
    num_completion = len(trajectory.completion)
    if isinstance(advantage, Sequence):
        advantages_C = list(advantage)
        if len(advantages_C) != num_completion:
            raise ValueError(
                f"policy_datum: {len(advantages_C)} advantages for {num_completion} completion "
                "tokens; give one per token or a single number"
            )
    else:
        advantages_C = [advantage] * num_completion
    if trajectory.action_mask is not None:
        # Observation tokens of a multi-turn episode: the environment wrote them, nothing trains.
        advantages_C = [
            a if m else 0.0 for a, m in zip(advantages_C, trajectory.action_mask, strict=True)
        ]
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * num_prompt_targets + trajectory.sampler_logprobs,
            "advantages": [0.0] * num_prompt_targets + advantages_C,
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
