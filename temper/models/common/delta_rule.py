"""The gated delta rule (Gated DeltaNet's token mixer), in two forms of the same function.

Shapes: B batch, T tokens, N heads (value heads; queries and keys already repeated to them),
K key head dim, V value head dim, C chunk length, M chunks (T padded to M * C).

Per head the state S [K, V] evolves token by token as

    P_t = a_t S_{t-1}                                (decay)
    S_t = P_t + k_t (beta_t (v_t - P_t^T k_t))^T      (write the correction: the delta rule)
    o_t = S_t^T q_t

with a_t = exp(g_t) (g_t <= 0 the log decay), beta_t in (0, 1) the write strength, and q, k
L2-normalized (in fp32, eps 1e-6) with q scaled by K**-0.5. Everything runs in fp32.

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

DEFAULT_CHUNK_SIZE = 64


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
    q_BTNK: torch.Tensor,
    k_BTNK: torch.Tensor,
    v_BTNV: torch.Tensor,
    g_BTN: torch.Tensor,
    beta_BTN: torch.Tensor,
    *,
    state_BNKV: torch.Tensor | None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_BTNV in v's dtype, final state_BNKV fp32) over the whole sequence in chunks of
    `chunk_size`, from `state_BNKV` (None: zeros)."""
    q_BNTK, k_BNTK, v_BNTV, g_BNT, beta_BNT = _heads_first(q_BTNK, k_BTNK, v_BTNV, g_BTN, beta_BTN)
    B, N, T, K = k_BNTK.shape
    V = v_BNTV.shape[-1]
    C = chunk_size
    pad = -T % C
    if pad:
        q_BNTK, k_BNTK, v_BNTV = (F.pad(x, (0, 0, 0, pad)) for x in (q_BNTK, k_BNTK, v_BNTV))
        g_BNT, beta_BNT = (F.pad(x, (0, pad)) for x in (g_BNT, beta_BNT))
    M = (T + pad) // C
    # Fold batch and heads into one dim (X = B * N) so the chunk loop runs 3D batched matmuls.
    q_XMCK, k_XMCK = (x.reshape(B * N, M, C, K) for x in (q_BNTK, k_BNTK))
    v_XMCV = v_BNTV.reshape(B * N, M, C, V)
    G_XMC = g_BNT.reshape(B * N, M, C).cumsum(dim=-1)
    beta_XMC1 = beta_BNT.reshape(B * N, M, C, 1)

    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q_XMCK.device).tril()
    log_decay_XMCC = (G_XMC[..., :, None] - G_XMC[..., None, :]).masked_fill(~causal_CC, -torch.inf)
    decay_XMCC = log_decay_XMCC.exp()  # exp(G_i - G_j) for j <= i, else 0
    k_beta_XMCK = k_XMCK * beta_XMC1
    G_exp_XMC1 = G_XMC.exp().unsqueeze(-1)

    # The UT transform: solve (I + strictly_lower(A)) [u, w] = [beta v, beta k exp(G)].
    A_XMCC = (k_beta_XMCK @ k_XMCK.transpose(-1, -2)) * decay_XMCC
    rhs_XMCY = torch.cat((v_XMCV * beta_XMC1, k_beta_XMCK * G_exp_XMC1), dim=-1)
    uw_XMCY = torch.linalg.solve_triangular(A_XMCC, rhs_XMCY, upper=False, unitriangular=True)
    u_XMCV, w_XMCK = uw_XMCY.split((V, K), dim=-1)

    attn_XMCC = (q_XMCK @ k_XMCK.transpose(-1, -2)) * decay_XMCC
    # What reads the incoming state: decayed queries (the outputs) and w (the new values).
    readers_XMRK = torch.cat((q_XMCK * G_exp_XMC1, w_XMCK), dim=-2)  # R = 2C
    G_last_XM1 = G_XMC[..., -1:]
    writers_XMKC = (k_XMCK * (G_last_XM1 - G_XMC).exp().unsqueeze(-1)).transpose(-1, -2)
    chunk_decay_XM11 = G_last_XM1.exp().unsqueeze(-1)

    S_XKV = (
        q_XMCK.new_zeros(B * N, K, V)
        if state_BNKV is None
        else state_BNKV.reshape(B * N, K, V).float()
    )
    # Per-chunk views by unbind, not indexing: indexing's backward would fill a zero tensor of
    # the whole size for every chunk; unbind's stacks the M gradients once.
    per_chunk = zip(
        readers_XMRK.unbind(1),
        u_XMCV.unbind(1),
        attn_XMCC.unbind(1),
        writers_XMKC.unbind(1),
        chunk_decay_XM11.unbind(1),
        strict=True,
    )
    outs = []
    for readers_XRK, u_XCV, attn_XCC, writers_XKC, chunk_decay_X11 in per_chunk:
        read_XRV = readers_XRK @ S_XKV
        v_new_XCV = u_XCV - read_XRV[:, C:]
        outs.append(torch.baddbmm(read_XRV[:, :C], attn_XCC, v_new_XCV))
        S_XKV = torch.baddbmm(S_XKV * chunk_decay_X11, writers_XKC, v_new_XCV)
    out_BNTV = torch.stack(outs, dim=1).reshape(B, N, M * C, V)[:, :, :T]
    return out_BNTV.transpose(1, 2).to(v_BTNV.dtype), S_XKV.reshape(B, N, K, V)
