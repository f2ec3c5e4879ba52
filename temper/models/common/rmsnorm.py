"""RMSNorm with the reference numerics: normalize in fp32, cast back, then scale.

The multiply by `weight` happens after the cast back to the input dtype (as in the HF Qwen3
reference), which matters for bit-level parity in bf16. For fp32 inputs torch's own
`F.rms_norm` gives bitwise the same values with one op instead of seven, which matters in
decode loops where each op's fixed cost dominates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_normalize_fp32(x: torch.Tensor, *, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, without a weight, in fp32 whatever x's dtype."""
    x_fp32 = x.float()
    variance = x_fp32.pow(2).mean(-1, keepdim=True)
    return x_fp32 * torch.rsqrt(variance + eps)


def rms_normalize(x: torch.Tensor, *, eps: float) -> torch.Tensor:
    """`rms_normalize_fp32` cast back to x's dtype (what `RMSNorm` scales by its weight)."""
    return rms_normalize_fp32(x, eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * rms_normalize(x, eps=self.eps)
