"""Turn (prompt, completion) token lists into right-padded next-token training batches.

Shapes: B batch, T tokens.

Inputs are the sequence without its last token, targets the sequence shifted by one, and the
weight of a position is 1 where its target is a completion token (the loss never trains the
model to predict the prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenBatch:
    inputs_BT: torch.Tensor
    targets_BT: torch.Tensor
    weights_BT: torch.Tensor

    @property
    def num_loss_tokens(self) -> int:
        return int(self.weights_BT.sum())

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(
            inputs_BT=self.inputs_BT.to(device),
            targets_BT=self.targets_BT.to(device),
            weights_BT=self.weights_BT.to(device),
        )


def completion_batch(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]], *, pad_token_id: int
) -> TokenBatch:
    """Batch (prompt_ids, completion_ids) pairs; loss weight on completion targets only."""
    lengths = [len(prompt) + len(completion) - 1 for prompt, completion in examples]
    width = max(lengths)
    inputs_BT = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    targets_BT = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    weights_BT = torch.zeros((len(examples), width), dtype=torch.float32)
    for row, (prompt, completion) in enumerate(examples):
        if not prompt or not completion:
            raise ValueError(f"example {row}: prompt and completion must both be non-empty")
        sequence = torch.tensor([*prompt, *completion], dtype=torch.long)
        length = lengths[row]
        inputs_BT[row, :length] = sequence[:-1]
        targets_BT[row, :length] = sequence[1:]
        weights_BT[row, len(prompt) - 1 : length] = 1.0
    return TokenBatch(inputs_BT=inputs_BT, targets_BT=targets_BT, weights_BT=weights_BT)
