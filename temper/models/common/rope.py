"""Rotary position embeddings (the "rotate half" layout used by Qwen, Llama and HF).

Shapes: B batch, T tokens, N heads, H head dim.

cos/sin are computed from the positions on every forward (an outer product in fp32) instead of
being stored as buffers: nothing to re-create after meta-device materialization, any position is
allowed, and the values are bitwise those of the HF reference.

The reference rotation is x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]. Here
the sign moves into the table: `rope_cos_sin` returns the sine with its first half negated, so
the rotation is x * cos + roll(x, H/2) * sin, with roll(x) = [x2, x1]. (-a) * b and a * (-b)
are the same float, so the result is bitwise the reference one, in four ops instead of eight
(it runs for queries and keys in every layer of every decode step).
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions_BT: torch.Tensor, *, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos_B1TH, signed_sin_B1TH) for integer positions, cast to `dtype`, shaped to broadcast
    over heads: the tables `apply_rope` takes."""
    exponents_H2 = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions_BT.device)
    inv_freq_H2 = 1.0 / (theta ** (exponents_H2.float() / head_dim))
    angles_B1TH2 = positions_BT.float()[:, None, :, None] * inv_freq_H2
    cos_B1TH2, sin_B1TH2 = angles_B1TH2.cos(), angles_B1TH2.sin()
    cos_B1TH = torch.cat((cos_B1TH2, cos_B1TH2), dim=-1)
    signed_sin_B1TH = torch.cat((-sin_B1TH2, sin_B1TH2), dim=-1)
    return cos_B1TH.to(dtype), signed_sin_B1TH.to(dtype)


def apply_rope(
    x_BNTH: torch.Tensor, cos_B1TH: torch.Tensor, signed_sin_B1TH: torch.Tensor
) -> torch.Tensor:
    """Rotate queries or keys laid out as [B, N, T, H] (tables from `rope_cos_sin`)."""
    return x_BNTH * cos_B1TH + x_BNTH.roll(x_BNTH.shape[-1] // 2, dims=-1) * signed_sin_B1TH
