"""Completion batches: shifted targets, right padding, loss weight on completions only."""

from __future__ import annotations

import pytest
import torch

from temper.sft.batches import completion_batch


def test_shift_padding_and_weights():
    batch = completion_batch([([5, 6, 7], [8, 2]), ([9], [4])], pad_token_id=0)
    assert batch.inputs_BT.tolist() == [[5, 6, 7, 8], [9, 0, 0, 0]]
    assert batch.targets_BT.tolist() == [[6, 7, 8, 2], [4, 0, 0, 0]]
    assert batch.weights_BT.tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert batch.num_loss_tokens == 3
    assert batch.weights_BT.dtype == torch.float32


def test_empty_parts_are_rejected_with_the_index():
    with pytest.raises(ValueError, match="example 1"):
        completion_batch([([1], [2]), ([], [3])], pad_token_id=0)
