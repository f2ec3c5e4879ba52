"""Grouped-query self-attention with optional per-head q/k RMSNorm, on SDPA.

Shapes: B batch, T tokens, D model dim, N query heads, K key/value heads, H head dim.

Causal attention over right-padded batches needs no mask: a real token never attends to the
padding that follows it, so each sequence's outputs equal its unpadded forward. Left padding is
not supported here; callers pad on the right.

Where keys and values come from is pluggable: with no `AttentionBackend` a forward attends
causally over its own tokens (training, scoring); a sampler passes a backend that writes them
to its KV cache and attends over the cache. The model itself never holds a cache.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from temper.models.common.rmsnorm import RMSNorm
from temper.models.common.rope import apply_rope


class AttentionBackend(Protocol):
    def attend(
        self, layer_index: int, q_BNTH: torch.Tensor, k_BKTH: torch.Tensor, v_BKTH: torch.Tensor
    ) -> torch.Tensor:
        """Attention output [B, N, T, H] for this layer's rotated queries, keys and values."""
        ...


def causal_attention(
    q_BNTH: torch.Tensor, k_BKTH: torch.Tensor, v_BKTH: torch.Tensor
) -> torch.Tensor:
    return _attention(q_BNTH, k_BKTH, v_BKTH, is_causal=True)


def masked_attention(
    q_BNTH: torch.Tensor, k_BKCH: torch.Tensor, v_BKCH: torch.Tensor, *, visible_B1TC: torch.Tensor
) -> torch.Tensor:
    """Attention over C key positions (a KV cache's), each query seeing those `visible_B1TC`
    marks True.

    On CUDA, grouped heads go through `grouped_masked_attention`: SDPA takes `enable_gqa`
    with a mask only in its math kernel, which upcasts to fp32 and copies keys and values
    per query head; without `enable_gqa` the memory-efficient kernel takes the mask. CPU
    keeps SDPA's own grouping (its results are what the CPU tests pin bitwise)."""
    if q_BNTH.device.type == "cuda" and q_BNTH.shape[1] != k_BKCH.shape[1]:
        return grouped_masked_attention(q_BNTH, k_BKCH, v_BKCH, visible_B1TC=visible_B1TC)
    return _attention(q_BNTH, k_BKCH, v_BKCH, attn_mask=visible_B1TC)


def grouped_masked_attention(
    q_BNTH: torch.Tensor, k_BKCH: torch.Tensor, v_BKCH: torch.Tensor, *, visible_B1TC: torch.Tensor
) -> torch.Tensor:
    """`masked_attention` with each key/value head's G = N / K query heads folded into its
    query positions ([B, K, G * T, H]), so SDPA sees as many query heads as key heads and
    needs no `enable_gqa`: no key/value head is copied. Query head n reads key head n // G,
    as `enable_gqa` pairs them; each of the G copies of a query position keeps its mask row."""
    B, N, T, H = q_BNTH.shape
    K, C = k_BKCH.shape[1], k_BKCH.shape[2]
    G = N // K
    q_BKXH = q_BNTH.reshape(B, K, G * T, H)  # X = G * T, group member major
    visible_B1XC = visible_B1TC[:, :, None].expand(B, 1, G, T, C).reshape(B, 1, G * T, C)
    out_BKXH = F.scaled_dot_product_attention(
        q_BKXH, k_BKCH, v_BKCH, attn_mask=visible_B1XC, scale=H**-0.5
    )
    return out_BKXH.reshape(B, N, T, H)


def _attention(
    q_BNTH: torch.Tensor, k_BKTH: torch.Tensor, v_BKTH: torch.Tensor, **mask: Any
) -> torch.Tensor:
    """SDPA at the head dim's scale, with grouped key/value heads when there are fewer."""
    return F.scaled_dot_product_attention(
        q_BNTH,
        k_BKTH,
        v_BKTH,
        **mask,
        scale=q_BNTH.shape[-1] ** -0.5,
        enable_gqa=q_BNTH.shape[1] != k_BKTH.shape[1],
    )


class GroupedQueryAttention(nn.Module):
    def __init__(
        self,
        *,
        layer_index: int,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool,
        bias: bool,
        norm_eps: float,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, num_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(num_heads * head_dim, dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None

    def project_qkv(
        self, x_BTD: torch.Tensor, cos_B1TH: torch.Tensor, signed_sin_B1TH: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values as [B, heads, T, H], normalized and rotated."""
        B, T, _ = x_BTD.shape
        q_BTNH = self.wq(x_BTD).view(B, T, self.num_heads, self.head_dim)
        k_BTKH = self.wk(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        v_BTKH = self.wv(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BTNH = self.q_norm(q_BTNH)
            k_BTKH = self.k_norm(k_BTKH)
        q_BNTH = apply_rope(q_BTNH.transpose(1, 2), cos_B1TH, signed_sin_B1TH)
        k_BKTH = apply_rope(k_BTKH.transpose(1, 2), cos_B1TH, signed_sin_B1TH)
        return q_BNTH, k_BKTH, v_BTKH.transpose(1, 2)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_B1TH: torch.Tensor,
        signed_sin_B1TH: torch.Tensor,
        attention: AttentionBackend | None = None,
    ) -> torch.Tensor:
        q_BNTH, k_BKTH, v_BKTH = self.project_qkv(x_BTD, cos_B1TH, signed_sin_B1TH)
        if attention is None:
            out_BNTH = causal_attention(q_BNTH, k_BKTH, v_BKTH)
        else:
            out_BNTH = attention.attend(self.layer_index, q_BNTH, k_BKTH, v_BKTH)
        B, _, T, _ = out_BNTH.shape
        return self.wo(out_BNTH.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
