"""Llama 3 model: sizes and their published parameter counts, seeded meta build, no q/k norms,
the llama3 RoPE scaling against its defining rule, config validation."""

from __future__ import annotations

import math

import pytest
import torch

from temper.models import LLAMA_SIZES, Llama, llama_size, materialize
from temper.models.common.rope import Llama3RopeScaling
from temper.models.registry import family, family_of_model


def test_tiny_builds_seeded_without_qk_norms():
    config = llama_size("tiny", vocab_size=41)
    first, second = materialize(config, seed=7), materialize(config, seed=7)
    for (name, a), (_, b) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert not any("q_norm" in name or "k_norm" in name for name in first.state_dict())
    assert sum(p.numel() for p in first.parameters()) == config.num_params
    assert family_of_model(first) is family("llama")
    assert config.max_seq_len > config.rope_scaling.original_max_position_embeddings


@pytest.mark.parametrize(
    ("size", "billions", "tied"),
    [("1B", 1.236, True), ("3B", 3.213, True), ("8B", 8.030, False), ("70B", 70.554, False)],
)
def test_published_sizes_have_published_parameter_counts(size, billions, tied):
    config = LLAMA_SIZES[size]
    assert config.num_params / 1e9 == pytest.approx(billions, rel=0.005)
    assert config.tie_embeddings is tied
    assert config.rope_scaling.factor == (32.0 if tied else 8.0)


def test_unknown_size_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown Llama size 'huge'.*tiny, 1B, 3B, 8B, 70B"):
        llama_size("huge")


def test_llama3_scaling_follows_its_three_bands():
    scaling = Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    inv_freq = torch.tensor([1.0, 2 * math.pi / 8, 2 * math.pi / 32, 2 * math.pi / 1000])
    scaled = scaling.scale(inv_freq)
    # Short wavelengths (< 64 / 4) are kept, long ones (> 64 / 1) divided by the factor.
    assert scaled[0] == inv_freq[0] and scaled[1] == inv_freq[1]
    torch.testing.assert_close(scaled[3], inv_freq[3] / 8)
    # Between: (1 - s) * f / factor + s * f with s = (64 / wavelength - 1) / (4 - 1).
    smooth = (64 / 32 - 1) / 3
    torch.testing.assert_close(scaled[2], (1 - smooth) * inv_freq[2] / 8 + smooth * inv_freq[2])


def test_scaling_validation_names_the_field():
    with pytest.raises(ValueError, match=r"high_freq_factor=1\.0 must exceed low_freq_factor=1\.0"):
        Llama3RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=1.0,
            original_max_position_embeddings=64,
        )
    with pytest.raises(ValueError, match=r"Llama\.Config\.num_kv_heads=3 must divide"):
        Llama.Config(
            vocab_size=8, dim=8, num_layers=1, num_heads=4, num_kv_heads=3, head_dim=2, ffn_dim=8
        )
