"""Decode attention over the KV cache against SDPA on each row's visible prefix alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from temper.sampler.kv_cache import DecodeAttention, KVCache, KVCacheShape

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_decode_attention_matches_sdpa_over_each_rows_prefix(dtype, rtol):
    generator = torch.Generator().manual_seed(0)
    shape = KVCacheShape(
        num_layers=2, num_slots=5, num_kv_heads=NUM_KV_HEADS, max_seq_len=12, head_dim=HEAD_DIM
    )
    cache = KVCache(shape, dtype=dtype, device=torch.device("cpu"))
    # Stale values everywhere (earlier occupants, padding): the mask must hide them.
    cache.k_LSKCH.copy_(torch.randn(shape.dims, generator=generator) * 50)
    cache.v_LSKCH.copy_(torch.randn(shape.dims, generator=generator) * 50)
    positions_B = torch.tensor([0, 7, 3, 9])
    num_rows = positions_B.shape[0]

    def randn(*size):
        return torch.randn(size, generator=generator).to(dtype)

    q_BN1H = randn(num_rows, NUM_HEADS, 1, HEAD_DIM)
    k_BK1H, v_BK1H = (
        randn(num_rows, NUM_KV_HEADS, 1, HEAD_DIM),
        randn(num_rows, NUM_KV_HEADS, 1, HEAD_DIM),
    )
    layer_0_keys = cache.k_LSKCH[0].clone()
    attention = DecodeAttention(cache, positions_B, width=int(positions_B.max()) + 1)
    out_BN1H = attention.attend(1, q_BN1H, k_BK1H, v_BK1H)
    assert out_BN1H.dtype == dtype and out_BN1H.shape == q_BN1H.shape

    for row, position in enumerate(positions_B.tolist()):
        k_K1H = cache.k_LSKCH[1, row, :, position : position + 1]
        assert torch.equal(k_K1H, k_BK1H[row])  # the new key was written at its position
        expected_N1H = F.scaled_dot_product_attention(
            q_BN1H[row : row + 1].float(),
            cache.k_LSKCH[1, row : row + 1, :, : position + 1].float(),
            cache.v_LSKCH[1, row : row + 1, :, : position + 1].float(),
            enable_gqa=True,
        )[0]
        torch.testing.assert_close(out_BN1H[row].float(), expected_N1H, rtol=rtol, atol=1e-5)
    assert torch.equal(cache.k_LSKCH[0], layer_0_keys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_cache_starts_as_zeros_of_its_own(dtype):
    """The lazily zero-filled CPU cache is torch.zeros: same values, shape, strides; each
    tensor its own memory."""
    shape = KVCacheShape(num_layers=2, num_slots=3, num_kv_heads=2, max_seq_len=40, head_dim=8)
    cache = KVCache(shape, dtype=dtype, device=torch.device("cpu"))
    expected = torch.zeros(shape.dims, dtype=dtype)
    for tensor in (cache.k_LSKCH, cache.v_LSKCH):
        assert tensor.dtype == dtype and tensor.stride() == expected.stride()
        assert torch.equal(tensor, expected)
    cache.k_LSKCH[1, 2, :, 5:9] = 3.0
    assert cache.k_LSKCH.count_nonzero() == 2 * 4 * 8 and not cache.v_LSKCH.any()
    assert cache.nbytes == shape.nbytes(dtype)
    empty = KVCache(
        KVCacheShape(num_layers=1, num_slots=0, num_kv_heads=1, max_seq_len=4, head_dim=2),
        dtype=dtype,
        device=torch.device("cpu"),
    )
    assert empty.k_LSKCH.shape == (1, 0, 1, 4, 2)
