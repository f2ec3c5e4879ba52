"""The gated delta rule (Gated DeltaNet's token mixer), in two forms of the same function.

Shapes: B batch, T tokens, N heads (value heads; the recurrent form takes queries and keys
repeated to them, the chunked form also H key heads, H dividing N), K key head dim, V value
head dim, C chunk length, M chunks (T padded to M * C).

Per head the state S [K, V] evolves token by token as

    P_t = a_t S_{t-1}                                (decay)
    S_t = P_t + k_t (beta_t (v_t - P_t^T k_t))^T      (write the correction: the delta rule)
    o_t = S_t^T q_t

with a_t = exp(g_t) (g_t <= 0 the log decay), beta_t in (0, 1) the write strength, and q, k
L2-normalized (in fp32, eps 1e-6) with q scaled by K**-0.5. Everything runs in fp32, with
autocast off: under a mixed-precision trainer's bf16 autocast the chunked form's batched
matmuls would otherwise run in bf16, where the generator's bf16 copy runs the rule in fp32
(one of the two sources of a bf16-mixed hybrid's extra sampler-trainer mismatch, the other
the conv: gated_deltanet.py; docs/benchmarks.md, `hybrid_mismatch_sources.py`), and the
chunked form's hand-written backward cannot take autocast's bf16 products.

`recurrent_gated_delta_rule` is that loop, one token at a time: the sampler's decode step.

`chunk_gated_delta_rule` is the full-sequence form (training, scoring, prefill): inside a chunk
the C sequential delta updates are one lower unit-triangular solve (the "UT transform": with
A[i, j] = beta_i k_i.k_j exp(G_i - G_j) for j < i, G the in-chunk cumulative log decay,
(I + A) [u, w] = [beta v, beta k exp(G)] gives each position's state-independent new value u
and the keys w it reads the chunk's incoming state with), so only the chunk-to-chunk state
passes through a Python loop, M iterations of five batched matmul-sized ops. The loop keeps its
outputs in a list (no in-place writes into a preallocated output: autograd would copy the
whole output once per chunk in backward).

A token with beta = 0 and g = 0 leaves the state as it was: right padding does that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from temper.models.common.delta_rule_chunked import ChunkedDeltaRule

DEFAULT_CHUNK_SIZE = 32
MIN_CHUNK_SIZE = 8


def l2_normalize(x: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the reference's, not F.normalize's, eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(
    q_BTNK: torch.Tensor,
    k_BTNK: torch.Tensor,
    v_BTNV: torch.Tensor,
    g_BTN: torch.Tensor,
    beta_BTN: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """fp32 [B, N, T, ...] copies, q and k normalized, q scaled."""
    q_BNTK = l2_normalize(q_BTNK.transpose(1, 2).float()) * q_BTNK.shape[-1] ** -0.5
    k_BNTK = l2_normalize(k_BTNK.transpose(1, 2).float())
    return (
        q_BNTK,
        k_BNTK,
        v_BTNV.transpose(1, 2).float(),
        g_BTN.transpose(1, 2).float(),
        beta_BTN.transpose(1, 2).float(),
    )


def recurrent_gated_delta_rule(
    q_BTNK: torch.Tensor,
    k_BTNK: torch.Tensor,
    v_BTNV: torch.Tensor,
    g_BTN: torch.Tensor,
    beta_BTN: torch.Tensor,
    *,
    state_BNKV: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_BTNV in v's dtype, final state_BNKV fp32), one token at a time from `state_BNKV`
    (None: zeros)."""
    with torch.autocast(v_BTNV.device.type, enabled=False):
        return _recurrent(q_BTNK, k_BTNK, v_BTNV, g_BTN, beta_BTN, state_BNKV=state_BNKV)


def _recurrent(
    q_BTNK: torch.Tensor,
    k_BTNK: torch.Tensor,
    v_BTNV: torch.Tensor,
    g_BTN: torch.Tensor,
    beta_BTN: torch.Tensor,
    *,
    state_BNKV: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_BNTK, k_BNTK, v_BNTV, g_BNT, beta_BNT = _heads_first(q_BTNK, k_BTNK, v_BTNV, g_BTN, beta_BTN)
    B, N, T, K = k_BNTK.shape
    V = v_BNTV.shape[-1]
    S_BNKV = k_BNTK.new_zeros(B, N, K, V) if state_BNKV is None else state_BNKV.float()
    outs = []
    for t in range(T):
        S_BNKV = S_BNKV * g_BNT[:, :, t, None, None].exp()
        k_BN1K = k_BNTK[:, :, t, None]
        read_BN1V = k_BN1K @ S_BNKV
        delta_BN1V = (v_BNTV[:, :, t, None] - read_BN1V) * beta_BNT[:, :, t, None, None]
        S_BNKV = S_BNKV + k_BN1K.transpose(-1, -2) @ delta_BN1V
        outs.append(q_BNTK[:, :, t, None] @ S_BNKV)
    out_BNTV = torch.cat(outs, dim=2) if outs else v_BNTV
    return out_BNTV.transpose(1, 2).to(v_BTNV.dtype), S_BNKV


def chunk_gated_delta_rule(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTNV: torch.Tensor,
    g_BTN: torch.Tensor,
    beta_BTN: torch.Tensor,
    *,
    state_BNKV: torch.Tensor | None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    short_chunk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_BTNV in v's dtype, final state_BNKV fp32) over the whole sequence in chunks of
    `chunk_size` (with `short_chunk`, a shorter sequence runs as one chunk of the next power
    of two, at least MIN_CHUNK_SIZE), from `state_BNKV` (None: zeros).

    q and k may come with fewer heads H than v's N (H divides N): value head n reads key head
    n // (N / H). They are normalized per key head, then repeated."""
    with torch.autocast(v_BTNV.device.type, enabled=False):
        if short_chunk:
            length = k_BTHK.shape[1]
            chunk_size = min(chunk_size, max(MIN_CHUNK_SIZE, 1 << (length - 1).bit_length()))
        return _chunked(
            q_BTHK, k_BTHK, v_BTNV, g_BTN, beta_BTN, state_BNKV=state_BNKV, chunk_size=chunk_size
        )


def _chunked(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTNV: torch.Tensor,
    g_BTN: torch.Tensor,
    beta_BTN: torch.Tensor,
    *,
    state_BNKV: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, _, K = k_BTHK.shape
    N, V = v_BTNV.shape[-2:]
    # short_chunk: a batch of 16-token prompts padded to a 32-token chunk ran its delta rule
    # 3-6x slower on CPU (the padded [B * N, C, C] products leave the cache).
    C = chunk_size
    pad = -T % C
    M = (T + pad) // C
    q_BTHK = l2_normalize(q_BTHK.float()) * K**-0.5
    k_BTHK = l2_normalize(k_BTHK.float())

    def fold(x_BTHY: torch.Tensor) -> torch.Tensor:
        """[B, T, H, Y] -> fp32 [M, B * N, C, Y] (heads repeated to N, T padded), one copy."""
        x_BTHY = F.pad(x_BTHY.float(), (0, 0, 0, 0, 0, pad))
        H, Y = x_BTHY.shape[-2:]
        x_BMCHGY = x_BTHY.unflatten(1, (M, C))[:, :, :, :, None].expand(B, M, C, H, N // H, Y)
        return x_BMCHGY.permute(1, 0, 3, 4, 2, 5).reshape(M, B * N, C, Y)

    def fold_heads(x_BTN: torch.Tensor) -> torch.Tensor:
        x_BMCN = F.pad(x_BTN.float(), (0, 0, 0, pad)).unflatten(1, (M, C))
        return x_BMCN.permute(1, 0, 3, 2).reshape(M, B * N, C)

    S_XKV = (
        q_BTHK.new_zeros(B * N, K, V)
        if state_BNKV is None
        else state_BNKV.reshape(B * N, K, V).float().contiguous()
    )
    out_MXCV, S_XKV = ChunkedDeltaRule.apply(  # autocast is off (chunk_gated_delta_rule)
        fold(q_BTHK), fold(k_BTHK), fold(v_BTNV), fold_heads(g_BTN), fold_heads(beta_BTN), S_XKV
    )
    out_BTNV = out_MXCV.view(M, B, N, C, V).permute(1, 0, 3, 2, 4).reshape(B, M * C, N, V)
    return out_BTNV[:, :T].to(v_BTNV.dtype), S_XKV.reshape(B, N, K, V)
