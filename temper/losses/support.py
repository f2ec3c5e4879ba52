"""Policy losses over the sampler's support: the trainer's distribution renormalised over the
tokens top-k/top-p kept when each token was drawn.

Shapes: N loss positions, K columns per position.

A sampler with top-p 0.9 reports the logprob of its token under the truncated distribution,
log q_S(x) = z_x / t - logsumexp_{y in S}(z_y / t) (z the logits, t its temperature, S the
kept set); the trainer's plain logprob, log p(x) = z_x - logsumexp_V(z), is normalised over
the whole vocabulary and at temperature 1, so their ratio is not 1 even with equal weights:
the importance ratio mixes the policy change with the truncation. Renormalising the trainer
over the same S at the same t compares like with like (ratio 1 at equal weights).

A datum asks for it with two more `loss_fn_inputs` on any policy loss:
- `target_tokens` [T, K]: column 0 the token drawn, columns 1.. the rest of its support
  (any order; padding repeats an id and is masked out);
- `support_mask` [T, K]: 1.0 on the support's columns (column 0 always), 0.0 on padding;
- `sampler_temperature` [T] (optional, default 1): the temperature each token was drawn at.
The trainer scores the K targets from one softmax (the top-K scoring path), and

    log q'_S(x) = lp_x / t - logsumexp_{k in S}(lp_k / t),   lp = the trainer's log p,

which equals z_x / t - logsumexp_S(z / t): the full-vocabulary normaliser of lp cancels. The
result is differentiable through lp (autograd), and it is the logprob the loss and the
`logprobs` output use. A prompt position (one column kept) gets 0, as its sampler logprob.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from temper.losses.base import LossSpec

SUPPORT_INPUTS = ("support_mask", "sampler_temperature")


def support_logprobs(
    logprobs_NK: torch.Tensor, *, inputs: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The logprob of column 0 renormalised over each row's support, at its temperature:
    [N, K] -> [N]. Datums without a `support_mask` ([N] logprobs) pass through."""
    mask_NK = inputs.get("support_mask")
    temperature_N = inputs.get("sampler_temperature")
    if logprobs_NK.ndim == 1:
        if mask_NK is not None or temperature_N is not None:
            raise ValueError(
                "loss_fn_inputs['support_mask'] and ['sampler_temperature'] need "
                "target_tokens of shape [T, K] (column 0 the token drawn, the rest its "
                "support); got [T]"
            )
        return logprobs_NK
    if mask_NK is None:
        raise ValueError(
            "loss_fn_inputs['target_tokens'] is [T, K], but a policy loss scores one token per "
            "position; give 'support_mask' [T, K] to renormalise over a sampler's support, or "
            "[T] targets"
        )
    keep_NK = mask_NK > 0
    if not bool(keep_NK[:, 0].all()):
        raise ValueError(
            "loss_fn_inputs['support_mask'] must be 1 in column 0 (the token drawn is in its "
            "own support)"
        )
    scaled_NK = logprobs_NK
    if temperature_N is not None:
        if not bool((temperature_N > 0).all()):
            raise ValueError(
                "loss_fn_inputs['sampler_temperature'] must be > 0 at every position (a "
                "greedy token has no support)"
            )
        scaled_NK = logprobs_NK / temperature_N[:, None]
    masked_NK = scaled_NK.masked_fill(~keep_NK, float("-inf"))
    return scaled_NK[:, 0] - torch.logsumexp(masked_NK, dim=-1)


def with_support(spec: LossSpec) -> LossSpec:
    """`spec` (a policy loss) that also takes a sampler's support (see the module doc)."""
    return dataclasses.replace(
        spec,
        optional_inputs=(*spec.optional_inputs, *SUPPORT_INPUTS),
        topk_inputs=("target_tokens", "support_mask"),
        position_logprobs=support_logprobs,
    )
