"""The support of a sampled token: the token ids top-k/top-p kept when it was drawn.

Shapes: V vocab, B rows.

`SamplingParams.return_support` asks for it. The representation is the kept ids of each
position, ascending: top-k bounds it by k, top-p by the tokens holding the top p of the mass,
which is far below V for the settings RL uses (a [V] bool mask per token would be 150k
entries on a Qwen vocabulary). Its cost is paid only by rows that ask: one `nonzero` per
row per step, in the engine's per-token Python work beside top-k logprobs.

A drawn row's logprobs (sampling.sampling_logprobs) are -inf exactly where truncation
removed a token, so the support is where they are finite: the set the draw used, not a
second computation that could disagree at a tie.
"""

from __future__ import annotations

import torch

from temper.api.types import SamplingParams
from temper.sampler.sampling import row_sort_width, sampling_logprobs


def kept_ids(logprobs_V: torch.Tensor) -> list[int]:
    """The ids of one drawn row's support (finite sampling logprobs), ascending."""
    return torch.isfinite(logprobs_V).nonzero().flatten().tolist()


def support_of_logits(logits_BV: torch.Tensor, params: SamplingParams) -> list[list[int]]:
    """The supports Temper's sampling transform keeps for rows of logits with `params`: the
    reference the engine's recorded supports are checked against (from a full forward)."""
    num_rows = logits_BV.shape[0]
    logprobs_BV = sampling_logprobs(
        logits_BV,
        temperature_B=torch.full((num_rows,), params.temperature),
        top_k_B=torch.full((num_rows,), max(params.top_k, 0), dtype=torch.long),
        top_p_B=torch.full((num_rows,), params.top_p, dtype=torch.float64),
        sort_width=row_sort_width(params),
    )
    return [kept_ids(row_V) for row_V in logprobs_BV]
