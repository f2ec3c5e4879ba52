"""DRO-style regularized policy gradient: loss_N = -(lp * A - beta / 2 * (lp - q)**2).

lp = trainer logprobs, q = sampler logprobs. The quadratic penalty pulls lp back toward q, so
the gradient -(A - beta * (lp - q)) vanishes at lp - q = A / beta: an off-policy update with
no ratio, hence no importance-weight blow-up. `beta` has no default (it sets the scale of
the step) and must be >= 0; a negative beta would reward drifting away from the sampler.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from temper.losses.base import LossSpec
from temper.losses.importance_sampling import POLICY_INPUTS


def check_dro_config(config: Mapping[str, float]) -> None:
    if config["beta"] < 0:
        raise ValueError(f"loss_fn_config beta for loss 'dro' must be >= 0, got {config['beta']}")


def dro(
    *, logprobs_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    drift_N = logprobs_N - inputs["logprobs"]
    return -(logprobs_N * inputs["advantages"] - 0.5 * config["beta"] * drift_N.square())


DRO = LossSpec(
    name="dro",
    fn=dro,
    required_inputs=POLICY_INPUTS,
    required_config=("beta",),
    check_config=check_dro_config,
)
