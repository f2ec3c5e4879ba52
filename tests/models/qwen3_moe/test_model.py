"""Qwen3-MoE model: sizes with their published total and active parameter counts, a seeded
meta build, the registry."""

from __future__ import annotations

import pytest
import torch

from temper.models import QWEN3_MOE_SIZES, materialize, qwen3_moe_size
from temper.models.registry import family, family_of_model


def test_tiny_builds_seeded_and_counts_its_parameters():
    config = qwen3_moe_size("tiny", vocab_size=41)
    first, second = materialize(config, seed=7), materialize(config, seed=7)
    for (name, a), (_, b) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert sum(p.numel() for p in first.parameters()) == config.num_params
    assert config.num_active_params < config.num_params
    assert family_of_model(first) is family("qwen3_moe")
    assert first.blocks[0].feed_forward.experts.w_gate.detach().std().item() == pytest.approx(
        0.02, rel=0.1
    )


@pytest.mark.parametrize(
    ("size", "total", "active"), [("30B-A3B", 30.53, 3.35), ("235B-A22B", 235.09, 22.14)]
)
def test_published_sizes_have_published_parameter_counts(size, total, active):
    config = QWEN3_MOE_SIZES[size]
    assert config.num_params / 1e9 == pytest.approx(total, rel=0.005)
    assert config.num_active_params / 1e9 == pytest.approx(active, rel=0.01)


def test_unknown_size_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown Qwen3-MoE size 'huge'.*tiny, 30B-A3B"):
        qwen3_moe_size("huge")
