"""CISPO (MiniMax-M1): loss_N = -stopgrad(clip(ratio, lo, hi)) * logprobs_N * A.

Unlike PPO no token's gradient is dropped: the clipped ratio is only a detached weight on
the REINFORCE term, so d loss / d logprobs = -clip(ratio) * A everywhere. Clip bounds and
their per-token overrides are PPO's (`clip_ratio`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from temper.losses.base import LossSpec
from temper.losses.importance_sampling import POLICY_INPUTS, importance_ratio
from temper.losses.ppo import CLIP_DEFAULTS, CLIP_KEYS, check_clip_config, clip_ratio


def cispo(
    *, logprobs_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    ratio_N = importance_ratio(logprobs_N.detach(), inputs=inputs)
    weight_N = clip_ratio(ratio_N, inputs=inputs, config=config)
    return -weight_N * logprobs_N * inputs["advantages"]


CISPO = LossSpec(
    name="cispo",
    fn=cispo,
    required_inputs=POLICY_INPUTS,
    optional_inputs=CLIP_KEYS,
    config_defaults=CLIP_DEFAULTS,
    check_config=check_clip_config,
)
