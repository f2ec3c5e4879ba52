"""Weighted negative log-likelihood: loss_N = -logprobs_N * weights_N.

Weights may be any real numbers, not only 0/1: `forward_backward_custom` sends
weights = -d(user loss)/d(logprobs), so this loss's gradient is the user's gradient.

`target_tokens` and `weights` may be [T, K] (top-K distillation: K candidate tokens per
position, each with its weight, from one softmax): loss = -sum_{t,k} w_tk * log p(x_tk), and
the logprobs come back [T, K]. Without `weights` every target weighs 1 (as the SDK's own
examples assume).
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch

from temper.losses.base import LossSpec


def cross_entropy(
    *, logprobs_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    return -logprobs_N * inputs["weights"]


def unit_weights(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.ones_like(inputs["target_tokens"], dtype=torch.float32)


CROSS_ENTROPY = LossSpec(
    name="cross_entropy",
    fn=cross_entropy,
    required_inputs=("target_tokens",),
    optional_inputs=("weights",),
    input_defaults=types.MappingProxyType({"weights": unit_weights}),
    topk_inputs=("target_tokens", "weights"),
)
