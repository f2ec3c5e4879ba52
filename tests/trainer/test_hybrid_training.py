"""A GRPO-shaped batch on a tiny hybrid model (Qwen3.5) through the trainer engine: the
shared-prefix packing stays off (its layout is exact only for attention), and the per-token
logprobs and the loss equal a plain forward of each datum; training steps lower the loss."""

from __future__ import annotations

import dataclasses

import torch

from temper.api import AdamParams
from temper.models import materialize
from temper.models.common.logprobs import forward_logprobs
from temper.models.qwen3_5 import qwen3_5_size
from temper.trainer import TrainerEngine
from temper.trainer.inputs import micro_batches
from temper.trainer.shared_prefix import packing_is_exact
from tests.trainer.test_shared_prefix import VOCAB, _grpo_data, _prepared


def test_grpo_batch_on_a_hybrid_model_equals_a_plain_forward_and_trains():
    config = dataclasses.replace(qwen3_5_size("tiny", vocab_size=VOCAB), init_std=0.1)
    assert not packing_is_exact(config)
    data = _grpo_data()
    # The same batch packs for attention-only models; the engine must not pack it here.
    assert all(
        b.layout is not None
        for b in micro_batches(_prepared(data), max_tokens=8192, share_prefixes=True)
    )
    engine = TrainerEngine.Config(share_prefixes=True).build(
        model=materialize(config, seed=0), lora=None
    )
    result = engine.forward_backward(data, "cross_entropy")
    expected_loss = 0.0
    with torch.no_grad():
        for datum, output in zip(data, result.loss_fn_outputs, strict=True):
            tokens_1T = torch.tensor([datum.model_input.to_ints()])
            targets_1T = datum.loss_fn_inputs["target_tokens"].to_torch()[None]
            logprobs_T = forward_logprobs(engine.model, tokens_1T, targets_1T)[0]
            torch.testing.assert_close(output["logprobs"].to_torch(), logprobs_T, rtol=0, atol=1e-5)
            expected_loss -= logprobs_T.sum().item()
    assert abs(result.metrics["loss:sum"] - expected_loss) <= 1e-4 * abs(expected_loss)
    losses = [result.metrics["loss:sum"]]
    for _ in range(3):
        engine.optim_step(AdamParams(learning_rate=1e-2))
        losses.append(engine.forward_backward(data, "cross_entropy").metrics["loss:sum"])
    assert losses[-1] < losses[0]
