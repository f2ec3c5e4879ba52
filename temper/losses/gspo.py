"""GSPO-token (Tinker's `gspo`): PPO's clipped surrogate on one importance ratio per sequence.

    s      = exp(mean_{t in M} (lp_t - q_t))        one value per datum
    s_t    = sg[s] * p(x_t) / sg[p(x_t)]             the value s, the gradient of its own token
    loss_t = -min(s_t * A_t, clip(s_t, lo, hi) * A_t)

lp = trainer logprobs, q = sampler logprobs (`logprobs` input), M = the datum's positions where
`sequence_ratio_mask` is nonzero. Unclipped, d loss_t / d lp_t = -s * A_t. Every position of a
datum carries its ratio (those outside M too, contributing 0 where A_t = 0), and the loss is a
plain sum over positions (Tinker's convention, not a per-sequence mean). A datum is one
sequence, so a multi-turn datum gets one ratio across its turns.

Temper's own choices (nothing public pins them): without `sequence_ratio_mask`, M is where
`advantages` is nonzero (the cookbook's rl/train.py sends none; this keeps prompt positions,
whose sampler logprobs are placeholder zeros, out of the mean); an empty M gives s = 1 (log
ratio 0). Clip bounds are PPO's: config `clip_low_threshold`/`clip_high_threshold` (0.8/1.2)
or per-token inputs of those names.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch

from temper.losses.base import LossSpec
from temper.losses.importance_sampling import POLICY_INPUTS
from temper.losses.ppo import CLIP_DEFAULTS, CLIP_KEYS, check_clip_config, clipped_surrogate


def nonzero_advantages(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The default `sequence_ratio_mask`: 1 where the advantage is nonzero."""
    return (inputs["advantages"] != 0).float()


def sequence_log_ratio(
    log_ratio_N: torch.Tensor, in_ratio_N: torch.Tensor, *, segments_N: torch.Tensor
) -> torch.Tensor:
    """Per position, the mean of its datum's `log_ratio_N` over `in_ratio_N` (0 if none)."""
    num_datums = int(segments_N[-1]) + 1
    sums_B = log_ratio_N.new_zeros(num_datums).index_add_(
        0, segments_N, torch.where(in_ratio_N, log_ratio_N, 0.0)
    )
    counts_B = log_ratio_N.new_zeros(num_datums).index_add_(0, segments_N, in_ratio_N.float())
    return (sums_B / counts_B.clamp(min=1.0))[segments_N]


def gspo(
    *,
    logprobs_N: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
    segments_N: torch.Tensor,
) -> torch.Tensor:
    in_ratio_N = inputs["sequence_ratio_mask"] != 0
    log_ratio_N = sequence_log_ratio(
        logprobs_N.detach() - inputs["logprobs"], in_ratio_N, segments_N=segments_N
    )
    ratio_N = torch.exp(log_ratio_N + logprobs_N - logprobs_N.detach())
    return clipped_surrogate(ratio_N, inputs=inputs, config=config)


GSPO = LossSpec(
    name="gspo",
    fn=gspo,
    required_inputs=POLICY_INPUTS,
    optional_inputs=("sequence_ratio_mask", *CLIP_KEYS),
    input_defaults=types.MappingProxyType({"sequence_ratio_mask": nonzero_advantages}),
    config_defaults=CLIP_DEFAULTS,
    check_config=check_clip_config,
    segmented=True,
)
