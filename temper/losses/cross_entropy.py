"""Weighted negative log-likelihood: loss_N = -logprobs_N * weights_N.

Weights may be any real numbers, not only 0/1: `forward_backward_custom` sends
weights = -d(user loss)/d(logprobs), so this loss's gradient is the user's gradient.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from temper.losses.base import LossSpec


def cross_entropy(
    *, logprobs_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    return -logprobs_N * inputs["weights"]


CROSS_ENTROPY = LossSpec(
    name="cross_entropy", fn=cross_entropy, required_inputs=("target_tokens", "weights")
)
