"""Prompt logprobs from the prefill's hidden states (Tinker: None at position 0).

Shapes: T prompt tokens, D model dim, V vocab, K top-k, N listed target cells, R rows that
name a target id.

Prompt logprobs are under the model's own distribution (temperature 1, no truncation), like
`score()`; top-k alternatives and target ids are computed a chunk of positions at a time so
[T, V] fp32 logits never exist at once. Target ids project only the positions that name one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from temper.api.prompt_targets import PLACEHOLDER, PromptTargetLogprobs, PromptTargets
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


def target_prompt_logprobs(
    model: nn.Module, hidden_TD: torch.Tensor, targets: PromptTargets
) -> PromptTargetLogprobs:
    """log p(id | prompt[:i + 1]) for each id of row i of `targets` (0.0 for -1 cells)."""
    device = hidden_TD.device
    ids_N = torch.tensor(targets.token_ids, dtype=torch.int64, device=device)
    rows_N = targets.rows_N().to(device)
    named_N = (ids_N != PLACEHOLDER).nonzero().squeeze(-1)
    # Row i is hidden_TD[i], which predicts prompt position i + 1. Cells are in row order
    # (CSR), so consecutive runs give the distinct rows; only those are projected.
    rows_R, row_of_named = torch.unique_consecutive(rows_N[named_N], return_inverse=True)
    hidden_RX, weight_VX = model.logit_inputs(hidden_TD[rows_R])
    chunk = max(1, DEFAULT_CHUNK_BYTES // (weight_VX.shape[0] * 4))
    logprobs_N = torch.zeros(len(targets.token_ids), dtype=torch.float32, device=device)
    for start in range(0, rows_R.shape[0], chunk):
        logprobs_RV = F.linear(hidden_RX[start : start + chunk], weight_VX).float()
        logprobs_RV = logprobs_RV.log_softmax(dim=-1)
        in_chunk = (row_of_named >= start) & (row_of_named < start + chunk)
        cells = named_N[in_chunk]
        logprobs_N[cells] = logprobs_RV[row_of_named[in_chunk] - start, ids_N[cells]]
    return PromptTargetLogprobs(
        shape=targets.shape,
        crow_indices=targets.crow_indices,
        col_indices=targets.col_indices,
        logprobs=tuple(logprobs_N.tolist()),
    )
