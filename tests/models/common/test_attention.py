"""The grouped layout CUDA uses for masked grouped-query attention (no `enable_gqa`, query
heads folded into positions) against SDPA's own grouping, which CPU keeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from temper.models.common.attention import grouped_masked_attention, masked_attention


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "num_queries"), [(8, 2, 1), (4, 4, 3), (6, 2, 5)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_layout_equals_sdpa_grouping(num_heads, num_kv_heads, num_queries, dtype):
    generator = torch.Generator().manual_seed(0)
    B, C, H = 3, 11, 16
    q_BNTH = torch.randn(B, num_heads, num_queries, H, generator=generator).to(dtype)
    k_BKCH = torch.randn(B, num_kv_heads, C, H, generator=generator).to(dtype)
    v_BKCH = torch.randn(B, num_kv_heads, C, H, generator=generator).to(dtype)
    # Each row sees a different prefix of the cache, each query one position more.
    lengths_B = torch.tensor([4, 7, 11 - num_queries])
    positions_BT = lengths_B[:, None] + torch.arange(num_queries)
    visible_B1TC = (torch.arange(C) <= positions_BT[..., None])[:, None]
    expected_BNTH = F.scaled_dot_product_attention(
        q_BNTH.float(),
        k_BKCH.float(),
        v_BKCH.float(),
        attn_mask=visible_B1TC,
        scale=H**-0.5,
        enable_gqa=num_heads != num_kv_heads,
    )
    grouped_BNTH = grouped_masked_attention(q_BNTH, k_BKCH, v_BKCH, visible_B1TC=visible_B1TC)
    assert grouped_BNTH.shape == q_BNTH.shape and grouped_BNTH.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped_BNTH.float(), expected_BNTH, atol=tolerance, rtol=0)


def test_cpu_keeps_sdpas_own_grouping_bitwise():
    generator = torch.Generator().manual_seed(1)
    q_BNTH = torch.randn(2, 4, 1, 8, generator=generator)
    k_BKCH, v_BKCH = torch.randn(2, 2, 2, 9, 8, generator=generator)
    visible_B1TC = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    expected = F.scaled_dot_product_attention(
        q_BNTH, k_BKCH, v_BKCH, attn_mask=visible_B1TC, scale=8**-0.5, enable_gqa=True
    )
    assert torch.equal(
        masked_attention(q_BNTH, k_BKCH, v_BKCH, visible_B1TC=visible_B1TC), expected
    )
