"""The two RMSNorms of Qwen3.5's hybrid decoder, with the reference numerics.

`ZeroCenteredRMSNorm` scales by (1 + weight), its weight initialised to zero: the block norms,
the final norm and the attention's q/k norms. The product is taken in fp32 and cast back once
(unlike `RMSNorm`, which casts back before scaling), as the HF reference does.

`GatedRMSNorm` is the Gated DeltaNet's output norm: a plain weight (initialised to one), cast
back before scaling, then times silu(gate) in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from temper.models.common.rmsnorm import rms_normalize_fp32


class ZeroCenteredRMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize_fp32(x, eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # The weight at x's dtype: under bf16 autocast over fp32 weights, the product is the
        # bf16 one a bf16 model computes (gated_deltanet.py says why).
        normalized = self.weight.to(x.dtype) * rms_normalize_fp32(x, eps=self.eps).to(x.dtype)
        return (normalized * F.silu(gate.float())).to(x.dtype)
