"""The chunked gated delta rule as one autograd node with a hand-written backward.

Shapes: X batch rows times value heads (folded), M chunks, C chunk length, K key head dim,
V value head dim, Y = V + K. Everything is fp32; q and k arrive normalized (q scaled), padded
to M * C tokens.

Per chunk, with G the in-chunk cumulative log decay (G_l its last entry) and
D[i, j] = exp(G_i - G_j) for j <= i (else 0):

    L  = strictly_lower(diag(beta) (k k^T) * D)        (the UT system, unit lower I + L)
    [u, w] = (I + L)^-1 [beta v, beta k exp(G)]      (new values, keys that read the state)
    P  = (q k^T) * D                                  (the in-chunk attention)

and the chunk-to-chunk recurrence from the incoming state S:

    vn  = u - w S                                     (the corrections the chunk writes)
    out = (q exp(G)) S + P vn
    S'  = exp(G_l) S + (k exp(G_l - G))^T vn

Only vn and S' need the Python loop over chunks (two batched matmuls each); the output is one
batched matmul over all chunks afterwards, from the saved incoming states. The backward is the
same recurrence reversed: a reverse loop carries dS (two batched matmuls a chunk), and every
other gradient is a batched product over all chunks at once. Autograd of the forward would
record a dozen small ops a chunk and replay them one by one; this node runs ~6 ops a chunk in
all. (I + L)^-1 is built once (diagonal blocks by a triangular solve, then block doubling) and
kept for the backward, where the solve's gradient is a product with its transpose.
"""

from __future__ import annotations

import torch

_BASE_BLOCK = 16
"""Diagonal block size the unit-lower inverse starts from (a batched triangular solve)."""


def unit_lower_inverse(L_ZCC: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower triangular L (Z any batch dims): triangular solves of the
    diagonal blocks, then doubling, [[A, 0], [B, E]]^-1 = [[A^-1, 0], [-E^-1 B A^-1, E^-1]].
    A batched solve of C x C systems runs C row sweeps per matrix; blocks of 16 and a few
    matmuls cost a fraction of that on CPU."""
    *Z, C, _ = L_ZCC.shape
    L_BCC = L_ZCC.reshape(-1, C, C)
    b = min(C, _BASE_BLOCK)
    if C % b or (C // b) & (C // b - 1):  # C / b not a power of two: solve directly
        eye_CC = torch.eye(C, dtype=L_ZCC.dtype, device=L_ZCC.device)
        inverse = torch.linalg.solve_triangular(
            L_BCC + eye_CC, eye_CC.expand_as(L_BCC), upper=False, unitriangular=True
        )
        return inverse.reshape(L_ZCC.shape)
    eye_bb = torch.eye(b, dtype=L_ZCC.dtype, device=L_ZCC.device)
    inverse_BNbb = torch.linalg.solve_triangular(
        _diagonal_blocks(L_BCC, b) + eye_bb,
        eye_bb.expand(L_BCC.shape[0], C // b, b, b),
        upper=False,
        unitriangular=True,
    )
    while b < C:
        n = C // (2 * b)
        pairs = inverse_BNbb.view(-1, n, 2, b, b)
        upper_inv, lower_inv = pairs[:, :, 0], pairs[:, :, 1]
        below = _diagonal_blocks(L_BCC, 2 * b)[..., b:, :b]
        merged = L_BCC.new_zeros(L_BCC.shape[0], n, 2 * b, 2 * b)
        merged[..., :b, :b] = upper_inv
        merged[..., b:, b:] = lower_inv
        merged[..., b:, :b] = -(lower_inv @ below @ upper_inv)
        inverse_BNbb, b = merged, 2 * b
    return inverse_BNbb.reshape(L_ZCC.shape)


def _diagonal_blocks(L_BCC: torch.Tensor, b: int) -> torch.Tensor:
    """The C / b diagonal b x b blocks of each matrix: [B, C / b, b, b] (a view)."""
    B, C, _ = L_BCC.shape
    n = C // b
    return L_BCC.view(B, n, b, n, b).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)


def _decay_matrix(G_XMC: torch.Tensor) -> torch.Tensor:
    """D[i, j] = exp(G_i - G_j) for j <= i, else 0: [X, M, C, C]."""
    C = G_XMC.shape[-1]
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=G_XMC.device).tril()
    log_decay = G_XMC[..., :, None] - G_XMC[..., None, :]
    return log_decay.masked_fill_(~causal_CC, -torch.inf).exp_()


class ChunkedDeltaRule(torch.autograd.Function):
    """(out_XMCV, final state_XKV) from q_XMCK, k_XMCK, v_XMCV, g_XMC (per-token log decay),
    beta_XMC and the incoming state_XKV, all fp32 and contiguous."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state):  # noqa: ANN001, ANN205 (autograd signature)
        X, M, C, K = k.shape
        V = v.shape[-1]
        G = g.cumsum(dim=-1)
        decay = _decay_matrix(G)
        exp_G = G.exp()
        kk = k @ k.transpose(-1, -2)
        L = kk * decay * beta[..., None]
        L.diagonal(dim1=-2, dim2=-1).zero_()
        inverse = unit_lower_inverse(L)
        rhs = torch.cat((v * beta[..., None], k * (beta * exp_G)[..., None]), dim=-1)
        uw = inverse @ rhs
        u, w = uw.split((V, K), dim=-1)
        writers = (k * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2)
        chunk_decay = exp_G[..., -1, None, None]
        incoming, corrections = [], []
        S = state
        for u_m, w_m, writers_m, decay_m in zip(
            u.unbind(1), w.unbind(1), writers.unbind(1), chunk_decay.unbind(1), strict=True
        ):
            incoming.append(S)
            vn = torch.baddbmm(u_m, w_m, S, alpha=-1)
            corrections.append(vn)
            S = torch.baddbmm(S * decay_m, writers_m, vn)
        S_in = torch.stack(incoming, dim=1)
        vn = torch.stack(corrections, dim=1)
        P = (q @ k.transpose(-1, -2)).mul_(decay)
        out = (q * exp_G[..., None]) @ S_in
        out.view(X * M, C, V).baddbmm_(P.view(X * M, C, C), vn.view(X * M, C, V))
        ctx.save_for_backward(q, k, v, beta, G, decay, kk, P, inverse, uw, S_in, vn)
        return out, S

    @staticmethod
    def backward(ctx, d_out, d_state):  # noqa: ANN001, ANN205 (autograd signature)
        q, k, v, beta, G, decay, kk, P, inverse, uw, S_in, vn = ctx.saved_tensors
        X, M, C, K = k.shape
        V = v.shape[-1]
        exp_G = G.exp()
        exp_tail = (G[..., -1:] - G).exp()
        writers = k * exp_tail[..., None]
        chunk_decay = exp_G[..., -1, None, None]
        d_out = d_out.contiguous()
        # The output's share of each chunk's dvn and incoming dS, batched over all chunks.
        d_vn_out = P.transpose(-1, -2) @ d_out
        d_S_out = (q * exp_G[..., None]).transpose(-1, -2) @ d_out
        w = uw[..., V:]
        dS = torch.zeros_like(S_in[:, 0]) if d_state is None else d_state.contiguous()
        d_next, d_vns = [None] * M, [None] * M
        for m in range(M - 1, -1, -1):
            d_next[m] = dS
            d_vn = torch.baddbmm(d_vn_out[:, m], writers[:, m], dS)
            d_vns[m] = d_vn
            dS = torch.baddbmm(
                torch.addcmul(d_S_out[:, m], dS, chunk_decay[:, m]),
                w[:, m].transpose(-1, -2),
                d_vn,
                alpha=-1,
            )
        d_next = torch.stack(d_next, dim=1)
        d_vn = torch.stack(d_vns, dim=1)

        d_writers = vn @ d_next.transpose(-1, -2)
        d_chunk_decay = (S_in * d_next).sum(dim=(-1, -2))
        d_P = d_out @ vn.transpose(-1, -2)
        d_q_decayed = d_out @ S_in.transpose(-1, -2)
        d_uw = torch.cat((d_vn, -(d_vn @ S_in.transpose(-1, -2))), dim=-1)
        d_rhs = inverse.transpose(-1, -2) @ d_uw
        d_L = (d_rhs @ uw.transpose(-1, -2)).neg_().tril_(-1)
        d_rhs_v, d_rhs_k = d_rhs.split((V, K), dim=-1)

        # L = beta_i (k k^T)_ij D_ij and P = (q k^T)_ij D_ij: their gradients to k k^T, q k^T,
        # and to the decays (H = dD * D, which feeds dG by rows minus columns).
        d_L_decayed = d_L * decay
        d_L_kk = d_L_decayed * kk
        d_kk = d_L_decayed * beta[..., None]
        d_qk = d_P * decay
        H = d_L_kk * beta[..., None] + d_P * P
        beta_k_exp = k * (beta * exp_G)[..., None]
        d_q = d_qk @ k + d_q_decayed * exp_G[..., None]
        d_k = (
            (d_kk + d_kk.transpose(-1, -2)) @ k
            + d_qk.transpose(-1, -2) @ q
            + d_writers * exp_tail[..., None]
            + d_rhs_k * (beta * exp_G)[..., None]
        )
        d_v = d_rhs_v * beta[..., None]
        d_beta = (
            (d_rhs_v * v).sum(-1)
            + (d_rhs_k * k).sum(-1) * exp_G
            + d_L_kk.sum(-1)
        )
        tail = (d_writers * writers).sum(-1)
        d_G = (
            H.sum(-1)
            - H.sum(-2)
            + (d_q_decayed * q).sum(-1) * exp_G
            - tail
            + (d_rhs_k * beta_k_exp).sum(-1)
        )
        d_G[..., -1] += tail.sum(-1) + d_chunk_decay * exp_G[..., -1]
        # G is the in-chunk cumulative sum of g: g's gradient is the reverse cumulative sum.
        d_g = d_G.flip(-1).cumsum(-1).flip(-1)
        return d_q, d_k, d_v, d_g, d_beta, dS if ctx.needs_input_grad[5] else None
