"""stable_reinforce, Temper's variant: truncated-importance-weighted REINFORCE.

    loss_N = -sg[min(exp(lp - q), max_ratio)] * A * lp  +  kl_coeff * mask * k3(lp, q)
    k3(lp, q) = exp(q - lp) - 1 - (q - lp)

lp is the trainer's logprob of each target, q the behaviour policy's (the distribution the
token was actually drawn from), A the advantage, sg a stop-gradient. The gradient is
-min(ratio, max_ratio) * A * d(lp): plain REINFORCE on-policy (ratio 1), an importance-
corrected one off-policy, and never more than max_ratio times the on-policy step however
stale or numerically different the sampler was. Unlike PPO no token's gradient is dropped,
unlike CISPO the weight is only bounded from above (a token the trainer now finds unlikely
keeps its small, unbiased weight).

Tinker has not published its stable_reinforce objective; this is Temper's own, documented in
docs/server.md. Where q comes from is the caller's business: in process it is the datum's
`logprobs`; `temper serve` replaces it, on every position a provenance span attributes to a
sampled token, with the logprob it recorded when it sampled that token
(`record_stability_info`), and sets `mask` to 1 there and 0 on prompt positions.

max_ratio defaults to 2.0, the cap of truncated importance sampling for sampler/trainer
mismatch (F. Yao et al., "Your efficient RL framework secretly brings you off-policy RL
training", 2025): it keeps the correction for the usual small mismatch (ratios near 1)
whole and bounds the rare large ratio. kl_coeff (Tinker's one documented key) adds the k3
estimate of the trainer's divergence from the behaviour policy (always >= 0, 0 where lp = q;
J. Schulman, "Approximating KL divergence", 2020) on the positions `mask` selects (every
position without one); default 0.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch

from temper.losses.base import LossSpec
from temper.losses.importance_sampling import POLICY_INPUTS

DEFAULTS = types.MappingProxyType({"max_ratio": 2.0, "kl_coeff": 0.0})


def check_config(config: Mapping[str, float]) -> None:
    if not config["max_ratio"] > 0:
        raise ValueError(
            f"loss_fn_config max_ratio of stable_reinforce must be > 0, got {config['max_ratio']}"
        )
    if not config["kl_coeff"] >= 0:
        raise ValueError(
            f"loss_fn_config kl_coeff of stable_reinforce must be >= 0, got {config['kl_coeff']}"
        )


def every_position(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """`mask` of a datum without one: the KL term on all its positions."""
    return torch.ones_like(inputs["advantages"])


def stable_reinforce(
    *, logprobs_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    behaviour_N = inputs["logprobs"]
    weight_N = torch.exp(logprobs_N.detach() - behaviour_N).clamp(max=config["max_ratio"])
    loss_N = -weight_N * inputs["advantages"] * logprobs_N
    if config["kl_coeff"] > 0:
        log_ratio_N = behaviour_N - logprobs_N
        k3_N = torch.exp(log_ratio_N) - 1 - log_ratio_N
        loss_N = loss_N + config["kl_coeff"] * inputs["mask"] * k3_N
    return loss_N


STABLE_REINFORCE = LossSpec(
    name="stable_reinforce",
    fn=stable_reinforce,
    required_inputs=POLICY_INPUTS,
    optional_inputs=("mask",),
    input_defaults=types.MappingProxyType({"mask": every_position}),
    config_defaults=DEFAULTS,
    check_config=check_config,
)
