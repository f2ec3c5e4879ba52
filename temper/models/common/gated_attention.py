"""Grouped-query attention with an output gate, partial rotary embeddings and zero-centred q/k
norms (Qwen3.5's full-attention layers).

Shapes: B batch, T tokens, D model dim, N query heads, K key/value heads, H head dim,
R rotary dims (the first R of each head; the rest pass through unrotated).

`wq` produces, per head, the query and a gate of the same width side by side ([query(H),
gate(H)] for head 0, then head 1, ...), as the HF checkpoints store q_proj. The attention output
is multiplied by sigmoid(gate) before `wo`. Keys and values come from an `AttentionBackend`
(a sampler's KV cache) when one is given, as in attention.py.
"""

from __future__ import annotations

import torch
from torch import nn

from temper.models.common.attention import AttentionBackend, causal_attention
from temper.models.common.centered_rmsnorm import ZeroCenteredRMSNorm
from temper.models.common.rope import apply_rope


def apply_partial_rope(
    x_BNTH: torch.Tensor, cos_B1TR: torch.Tensor, signed_sin_B1TR: torch.Tensor
) -> torch.Tensor:
    """Rotate the first R dims of each head (R = the tables' width), keep the rest."""
    rotary_dims = cos_B1TR.shape[-1]
    if rotary_dims == x_BNTH.shape[-1]:
        return apply_rope(x_BNTH, cos_B1TR, signed_sin_B1TR)
    rotated_BNTR = apply_rope(x_BNTH[..., :rotary_dims], cos_B1TR, signed_sin_B1TR)
    return torch.cat((rotated_BNTR, x_BNTH[..., rotary_dims:]), dim=-1)


class GatedAttention(nn.Module):
    def __init__(
        self,
        *,
        layer_index: int,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        norm_eps: float,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, 2 * num_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(num_heads * head_dim, dim, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps=norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps=norm_eps)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_B1TR: torch.Tensor,
        signed_sin_B1TR: torch.Tensor,
        attention: AttentionBackend | None = None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H = self.head_dim
        q_BTNH, gate_BTNH = self.wq(x_BTD).view(B, T, self.num_heads, 2 * H).split(H, dim=-1)
        k_BTKH = self.wk(x_BTD).view(B, T, self.num_kv_heads, H)
        v_BKTH = self.wv(x_BTD).view(B, T, self.num_kv_heads, H).transpose(1, 2)
        q_BNTH = apply_partial_rope(self.q_norm(q_BTNH).transpose(1, 2), cos_B1TR, signed_sin_B1TR)
        k_BKTH = apply_partial_rope(self.k_norm(k_BTKH).transpose(1, 2), cos_B1TR, signed_sin_B1TR)
        if attention is None:
            out_BNTH = causal_attention(q_BNTH, k_BKTH, v_BKTH)
        else:
            out_BNTH = attention.attend(self.layer_index, q_BNTH, k_BKTH, v_BKTH)
        out_BTX = out_BNTH.transpose(1, 2).reshape(B, T, self.num_heads * H)
        return self.wo(out_BTX * torch.sigmoid(gate_BTNH.reshape(B, T, self.num_heads * H)))
