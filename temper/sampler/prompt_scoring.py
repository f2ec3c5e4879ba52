"""Prompt logprobs from the prefill's hidden states (Tinker: None at position 0).

Shapes: T prompt tokens, D model dim, V vocab, K top-k.

Prompt logprobs are under the model's own distribution (temperature 1, no truncation), like
`score()`; top-k alternatives are computed a chunk of positions at a time so [T, V] fp32
logits never exist at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from temper.api.types import TopkLogprobs
from temper.models.common.logprobs import DEFAULT_CHUNK_BYTES, target_logprobs


def prompt_logprobs(
    model: nn.Module, hidden_TD: torch.Tensor, tokens_T: torch.Tensor
) -> list[float | None]:
    length = hidden_TD.shape[0]
    hidden_TX, weight_VX = model.logit_inputs(hidden_TD[: length - 1])
    scored_T = target_logprobs(hidden_TX[None], weight_VX, tokens_T[None, 1:length])
    return [None, *scored_T[0].tolist()]


def topk_prompt_logprobs(
    model: nn.Module, hidden_TD: torch.Tensor, *, k: int
) -> list[TopkLogprobs | None]:
    # position t predicts token t + 1
    predicting_TX, weight_VX = model.logit_inputs(hidden_TD[:-1])
    rows = max(1, DEFAULT_CHUNK_BYTES // (weight_VX.shape[0] * 4))
    result: list[TopkLogprobs | None] = [None]
    for start in range(0, predicting_TX.shape[0], rows):
        logprobs_TV = F.linear(predicting_TX[start : start + rows], weight_VX).float()
        logprobs_TV = logprobs_TV.log_softmax(dim=-1)
        values_TK, ids_TK = logprobs_TV.topk(k, dim=-1)
        for ids, values in zip(ids_TK.tolist(), values_TK.tolist(), strict=True):
            result.append(list(zip(ids, values, strict=True)))
    return result
