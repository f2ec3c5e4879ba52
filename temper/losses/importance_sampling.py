"""Off-policy REINFORCE: loss_N = -ratio_N * advantages_N, ratio = exp(logprobs - sampler logprobs).

The gradient is -ratio * advantages * d(logprobs): the policy gradient with an importance
weight correcting for tokens drawn by the sampler's (possibly older) policy. Nothing is
clipped, so a large ratio gives a large step; `ppo` and `cispo` bound it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from temper.losses.base import LossSpec

POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")
"""What every policy-gradient loss reads: targets, sampler logprobs (q) and advantages."""


def importance_ratio(
    logprobs_N: torch.Tensor, *, inputs: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """exp(lp - q): the trainer's over the sampler's probability of each target token."""
    return torch.exp(logprobs_N - inputs["logprobs"])


def importance_sampling(
    *, logprobs_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    return -importance_ratio(logprobs_N, inputs=inputs) * inputs["advantages"]


IMPORTANCE_SAMPLING = LossSpec(
    name="importance_sampling", fn=importance_sampling, required_inputs=POLICY_INPUTS
)
