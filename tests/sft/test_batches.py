"""Supervised datums: shifted targets, weights on trained tokens, per-token-mean normalization."""

from __future__ import annotations

import pytest
import torch

from temper.client.service_client import ServiceClient
from temper.sft.batches import completion_tokens, supervised_data
from temper.tokenizer.renderers import WeightedTokens


def test_datums_shift_targets_and_normalize_by_trained_tokens():
    examples = [completion_tokens([5, 6, 7], [8, 2]), completion_tokens([9], [4])]
    first, second = supervised_data(examples)
    assert first.model_input.to_ints() == [5, 6, 7, 8]
    assert first.loss_fn_inputs["target_tokens"].tolist() == [6, 7, 8, 2]
    assert first.loss_fn_inputs["weights"].tolist() == pytest.approx([0, 0, 1 / 3, 1 / 3])
    assert second.model_input.to_ints() == [9]
    assert second.loss_fn_inputs["weights"].tolist() == pytest.approx([1 / 3])


def test_empty_parts_and_nothing_to_train_are_errors():
    with pytest.raises(ValueError, match="0 prompt and 1 completion"):
        completion_tokens([], [3])
    with pytest.raises(ValueError, match="none of the 1 examples"):
        supervised_data([WeightedTokens(tokens=[1, 2], weights=[0.0, 0.0])])


def test_summed_loss_is_the_mean_loss_per_trained_token(tmp_path):
    training = ServiceClient(storage_dir=tmp_path).create_training_client("tiny")
    examples = [completion_tokens([5, 6, 7], [8, 9, 2]), completion_tokens([9, 4], [2])]
    output = training.forward(supervised_data(examples), "cross_entropy").result()
    logprobs = [out["logprobs"].to_torch() for out in output.loss_fn_outputs]
    trained = torch.cat([logprobs[0][2:], logprobs[1][1:]])
    assert output.metrics["loss:sum"] == pytest.approx(-trained.mean().item(), rel=1e-5)
