"""PPO's clipped surrogate: loss_N = -min(ratio * A, clip(ratio, lo, hi) * A).

No value function and no entropy term: advantages come from the caller. The clip bounds
come from `loss_fn_config` (`clip_low_threshold`, `clip_high_threshold`, defaults 0.8 / 1.2)
unless a datum carries them as per-token `loss_fn_inputs`, which then win position by
position. `cispo` shares the bounds (`clip_ratio`).
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch

from temper.losses.base import LossSpec
from temper.losses.importance_sampling import POLICY_INPUTS, importance_ratio

CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")
CLIP_DEFAULTS = types.MappingProxyType({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})


def check_clip_config(config: Mapping[str, float]) -> None:
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    if not low <= high:
        raise ValueError(
            f"loss_fn_config clip_low_threshold ({low}) must be <= clip_high_threshold ({high})"
        )


def clip_ratio(
    ratio_N: torch.Tensor, *, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    """clip(ratio, low, high), the bounds per token where `inputs` has them, else the config's."""
    low = inputs.get("clip_low_threshold", config["clip_low_threshold"])
    high = inputs.get("clip_high_threshold", config["clip_high_threshold"])
    # Two calls: torch.clamp wants both bounds numbers or both tensors, and either may be a
    # per-token tensor while the other is the config's number.
    return ratio_N.clamp(min=low).clamp(max=high)


def ppo(
    *, logprobs_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    ratio_N = importance_ratio(logprobs_N, inputs=inputs)
    return clipped_surrogate(ratio_N, inputs=inputs, config=config)


def clipped_surrogate(
    ratio_N: torch.Tensor, *, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    """-min(ratio * A, clip(ratio, lo, hi) * A), per token (PPO's, and GSPO's on its ratio)."""
    advantages_N = inputs["advantages"]
    unclipped_N = ratio_N * advantages_N
    clipped_N = clip_ratio(ratio_N, inputs=inputs, config=config) * advantages_N
    # Where the clipped term is the smaller, clamp cuts the gradient: the ratio has already
    # moved past the trust region in the direction the advantage pushes it.
    return -torch.minimum(unclipped_N, clipped_N)


PPO = LossSpec(
    name="ppo",
    fn=ppo,
    required_inputs=POLICY_INPUTS,
    optional_inputs=CLIP_KEYS,
    config_defaults=CLIP_DEFAULTS,
    check_config=check_clip_config,
)
