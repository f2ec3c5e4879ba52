"""A slow, obviously correct greedy decoder: one full forward per generated token.

Shapes: B batch, T tokens, V vocab.

It keeps no KV cache, so each new token costs a forward over the whole sequence. It is the
oracle that the KV-cache engine is tested against and is fast enough to evaluate tiny models
on short answers. Rows are right-padded; each row reads the logits at its own last position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


@torch.no_grad()
def greedy_decode(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
) -> list[list[int]]:
    """Greedy completions (stop token included when hit) for each prompt."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    lengths_B = torch.tensor([len(p) for p in prompts], device=device)
    tokens_BT = torch.full(
        (len(prompts), int(lengths_B.max()) + max_new_tokens), pad_token_id, device=device
    )
    for row, prompt in enumerate(prompts):
        tokens_BT[row, : len(prompt)] = torch.tensor(prompt, device=device)
    stop_ids = torch.tensor(list(stop_token_ids), device=device, dtype=torch.long)
    done_B = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    completions: list[list[int]] = [[] for _ in prompts]
    rows_B = torch.arange(len(prompts), device=device)
    for _ in range(max_new_tokens):
        width = int(lengths_B.max())
        logits_BTV = model(tokens_BT[:, :width])
        next_B = logits_BTV[rows_B, lengths_B - 1].argmax(dim=-1)
        for row in torch.nonzero(~done_B).flatten().tolist():
            completions[row].append(int(next_B[row]))
        tokens_BT[rows_B, lengths_B] = torch.where(done_B, pad_token_id, next_B)
        lengths_B = lengths_B + (~done_B).long()
        done_B |= torch.isin(next_B, stop_ids)
        if bool(done_B.all()):
            break
    return completions
