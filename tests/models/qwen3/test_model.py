"""Qwen3 model: construction on meta, seeded init, sizes, config validation, checkpointing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.distributed.parallel_dims import ParallelDims
from temper.models import QWEN3_SIZES, Qwen3, materialize, qwen3_size
from temper.models.common.logprobs import target_logprobs
from temper.models.qwen3.parallelize import parallelize_qwen3


def _tiny(**overrides) -> Qwen3.Config:
    return dataclasses.replace(qwen3_size("tiny", vocab_size=41), **overrides)


def test_meta_build_allocates_only_on_target_and_is_seeded():
    config = _tiny()
    first = materialize(config, seed=7)
    second = materialize(config, seed=7)
    third = materialize(config, seed=8)
    for (name, a), (_, b), (_, c) in zip(
        first.state_dict().items(),
        second.state_dict().items(),
        third.state_dict().items(),
        strict=True,
    ):
        assert a.device.type == "cpu", name
        assert torch.equal(a, b), name
        if "norm" not in name:
            assert not torch.equal(a, c), name
    assert sum(p.numel() for p in first.parameters()) == config.num_params


def test_init_std_and_norms():
    model = materialize(_tiny(init_std=0.05), seed=0)
    assert torch.all(model.norm.weight == 1)
    std = model.blocks[0].feed_forward.w_up.weight.std().item()
    assert 0.045 < std < 0.055


def test_bf16_materialization():
    model = materialize(_tiny(), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    logits_BTV = model(torch.tensor([[1, 2, 3]]))
    assert logits_BTV.dtype == torch.bfloat16 and torch.isfinite(logits_BTV).all()


@pytest.mark.parametrize(
    ("size", "billions"),
    [("0.6B", 0.596), ("1.7B", 1.72), ("4B", 4.02), ("8B", 8.19), ("14B", 14.77), ("32B", 32.76)],
)
def test_published_sizes_have_published_parameter_counts(size, billions):
    # Qwen3 model cards: 0.6B, 1.7B, 4B, 8.2B, 14.8B, 32.8B parameters.
    assert QWEN3_SIZES[size].num_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_unknown_size_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown Qwen3 size 'huge'.*tiny, 0\.6B"):
        qwen3_size("huge")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_kv_heads": 3}, "num_kv_heads=3 must divide num_heads=4"),
        ({"dim": 0}, r"Qwen3.Config.dim must be a positive int, got 0"),
        ({"head_dim": 31}, "head_dim must be even"),
    ],
)
def test_config_validation_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        _tiny(**overrides)


def test_activation_checkpointing_gives_identical_gradients():
    tokens_BT = torch.randint(0, 41, (2, 9), generator=torch.Generator().manual_seed(0))
    grads = []
    for mode in ("none", "full"):
        model = materialize(_tiny(), seed=3)
        # The one switch is the parallelize plan's (nothing parallel: mesh None).
        parallelize_qwen3(
            model,
            parallel_dims=ParallelDims.Config().build(world_size=1),
            mesh=None,
            activation_checkpointing=mode,
        )
        hidden_BTD = model.hidden_states(tokens_BT[:, :-1])
        loss = -target_logprobs(hidden_BTD, model.output_weight_VD, tokens_BT[:, 1:]).sum()
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, checkpointed in zip(*grads, strict=True):
        torch.testing.assert_close(checkpointed, plain, rtol=0, atol=1e-6)


def test_right_padding_leaves_real_positions_unchanged():
    model = materialize(_tiny(), seed=1).eval()
    tokens_T = torch.randint(0, 41, (11,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        alone = model(tokens_T[None])[0]
        for length in (11, 20, 40):
            padded_BT = torch.zeros(3, length, dtype=torch.long)
            padded_BT[1, :11] = tokens_T
            in_batch = model(padded_BT)[1, :11]
            # Not bitwise: the matmul row count and SDPA tiling change with the batch shape,
            # and with them the last bits (measured up to ~4e-7 on CPU).
            torch.testing.assert_close(in_batch, alone, rtol=0, atol=1e-6)


def test_positions_shift_matches_a_longer_sequence():
    model = materialize(_tiny(), seed=1).eval()
    tokens_BT = torch.randint(0, 41, (1, 6), generator=torch.Generator().manual_seed(4))
    positions_BT = torch.arange(6)[None]
    with torch.no_grad():
        default = model(tokens_BT)
        explicit = model(tokens_BT, positions_BT=positions_BT)
        shifted = model(tokens_BT, positions_BT=positions_BT + 5)
    assert torch.equal(default, explicit)
    assert not torch.equal(default[:, 1:], shifted[:, 1:])
