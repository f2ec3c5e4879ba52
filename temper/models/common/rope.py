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

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (HF `rope_type: llama3`): wavelengths longer than
    `original_max_position_embeddings / low_freq_factor` are stretched by `factor`, those
    shorter than `original_max_position_embeddings / high_freq_factor` kept, and the band
    between interpolated smoothly. The attention scale is unchanged."""

    factor: float
    """Stretch of the low frequencies (8.0 in Llama 3.1, 32.0 in Llama 3.2)."""
    low_freq_factor: float
    """Wavelengths above original_max_position_embeddings / low_freq_factor are scaled."""
    high_freq_factor: float
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int
    """Context length of the unscaled pretraining (8192 for Llama 3)."""

    def __post_init__(self) -> None:
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"Llama3RopeScaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )
        for name in ("factor", "low_freq_factor", "original_max_position_embeddings"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"Llama3RopeScaling.{name} must be positive, got {getattr(self, name)}"
                )

    def scale(self, inv_freq_H2: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies (same op order as the HF reference)."""
        original = self.original_max_position_embeddings
        low_freq_wavelen = original / self.low_freq_factor
        high_freq_wavelen = original / self.high_freq_factor
        wavelen_H2 = 2 * math.pi / inv_freq_H2
        scaled_H2 = torch.where(
            wavelen_H2 > low_freq_wavelen, inv_freq_H2 / self.factor, inv_freq_H2
        )
        smooth_H2 = (original / wavelen_H2 - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed_H2 = (1 - smooth_H2) * scaled_H2 / self.factor + smooth_H2 * scaled_H2
        is_medium_H2 = ~(wavelen_H2 < high_freq_wavelen) * ~(wavelen_H2 > low_freq_wavelen)
        return torch.where(is_medium_H2, smoothed_H2, scaled_H2)


def rope_cos_sin(
    positions_BT: torch.Tensor,
    *,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    scaling: Llama3RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos_B1TH, signed_sin_B1TH) for integer positions, cast to `dtype`, shaped to broadcast
    over heads: the tables `apply_rope` takes. `scaling` rescales the frequencies."""
    exponents_H2 = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions_BT.device)
    inv_freq_H2 = 1.0 / (theta ** (exponents_H2.float() / head_dim))
    if scaling is not None:
        inv_freq_H2 = scaling.scale(inv_freq_H2)
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
