"""RoPE: the signed-sine roll form is bitwise the reference rotate-half form."""

from __future__ import annotations

import torch

from temper.models.common.rope import apply_rope, rope_cos_sin


def _reference(x_BNTH, positions_BT, *, theta):
    # The textbook form: angles duplicated, x * cos + rotate_half(x) * sin.
    head_dim = x_BNTH.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions_BT.float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    first, second = x_BNTH.chunk(2, dim=-1)
    return x_BNTH * cos + torch.cat((-second, first), dim=-1) * sin


def test_rotation_is_bitwise_the_rotate_half_reference():
    generator = torch.Generator().manual_seed(0)
    x_BNTH = torch.randn(3, 4, 9, 32, generator=generator) * 7
    positions_BT = torch.randint(0, 40_000, (3, 9), generator=generator)
    cos, signed_sin = rope_cos_sin(positions_BT, head_dim=32, theta=1e6, dtype=torch.float32)
    rotated = apply_rope(x_BNTH, cos, signed_sin)
    assert torch.equal(rotated, _reference(x_BNTH, positions_BT, theta=1e6))


def test_rotation_keeps_norms_and_position_zero_is_identity():
    x_BNTH = torch.randn(2, 2, 5, 16)
    positions_BT = torch.zeros(2, 5, dtype=torch.long)
    cos, signed_sin = rope_cos_sin(positions_BT, head_dim=16, theta=1e4, dtype=torch.float32)
    assert torch.equal(apply_rope(x_BNTH, cos, signed_sin), x_BNTH)
    positions_BT = torch.arange(5).expand(2, 5) * 1000
    cos, signed_sin = rope_cos_sin(positions_BT, head_dim=16, theta=1e4, dtype=torch.float32)
    torch.testing.assert_close(
        apply_rope(x_BNTH, cos, signed_sin).norm(dim=-1), x_BNTH.norm(dim=-1), rtol=1e-5, atol=0
    )
