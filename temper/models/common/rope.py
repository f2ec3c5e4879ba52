"""Rotary position embeddings (the "rotate half" layout used by Qwen, Llama and HF).

Shapes: B batch, T tokens, N heads, H head dim.

cos/sin are computed from the positions on every forward (an outer product in fp32) instead of
being stored as buffers: nothing to re-create after meta-device materialization, any position is
allowed, and the values are bitwise those of the HF reference.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions_BT: torch.Tensor, *, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (cos_BTH, sin_BTH) for integer positions, cast to `dtype`."""
    exponents_H2 = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions_BT.device)
    inv_freq_H2 = 1.0 / (theta ** (exponents_H2.float() / head_dim))
    angles_BTH2 = positions_BT.float()[..., None] * inv_freq_H2
    angles_BTH = torch.cat((angles_BTH2, angles_BTH2), dim=-1)
    return angles_BTH.cos().to(dtype), angles_BTH.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x_BNTH: torch.Tensor, cos_BTH: torch.Tensor, sin_BTH: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys laid out as [B, N, T, H]."""
    cos_B1TH = cos_BTH.unsqueeze(1)
    sin_B1TH = sin_BTH.unsqueeze(1)
    return x_BNTH * cos_B1TH + _rotate_half(x_BNTH) * sin_B1TH
