"""The chunked gated delta rule as one autograd node with a hand-written backward.

Shapes: M chunks, X batch rows times value heads (folded), C chunk length, K key head dim,
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
    C = L_ZCC.shape[-1]
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


def _decay_matrix(G_MXC: torch.Tensor) -> torch.Tensor:
    """D[i, j] = exp(G_i - G_j) for j <= i, else 0: [M, X, C, C]."""
    C = G_MXC.shape[-1]
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=G_MXC.device).tril()
    log_decay = G_MXC[..., :, None] - G_MXC[..., None, :]
    return log_decay.masked_fill_(~causal_CC, -torch.inf).exp_()


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched matmul over the two leading dims (one bmm; transposed operands stay views)."""
    return torch.bmm(a.flatten(0, 1), b.flatten(0, 1)).view(*a.shape[:-1], b.shape[-1])


def _add_mm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, alpha: float = 1) -> None:
    """out += alpha * a @ b, batched over the two leading dims, in place."""
    out.flatten(0, 1).baddbmm_(a.flatten(0, 1), b.flatten(0, 1), alpha=alpha)


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


class ChunkedDeltaRule(torch.autograd.Function):
    """(out_MXCV, final state_XKV) from q_MXCK, k_MXCK, v_MXCV, g_MXC (per-token log decay),
    beta_MXC and the incoming state_XKV, all fp32 and contiguous. Chunks lead (M-major), so
    each chunk's slice of every tensor is contiguous for the loop."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state):
        M, X, C, K = k.shape
        V = v.shape[-1]
        G = g.cumsum(dim=-1)
        exp_G = G.exp()
        decay = _decay_matrix(G)
        kk = _mm(k, _t(k))
        L = kk * decay
        L.mul_(beta[..., None]).diagonal(dim1=-2, dim2=-1).zero_()
        inverse = unit_lower_inverse(L)
        rhs = k.new_empty(M, X, C, V + K)
        torch.mul(v, beta[..., None], out=rhs[..., :V])
        torch.mul(k, (beta * exp_G)[..., None], out=rhs[..., V:])
        uw = _mm(inverse, rhs)
        u, w = uw[..., :V], uw[..., V:]
        writers = k * (G[..., -1:] - G).exp()[..., None]
        chunk_decay = exp_G[..., -1, None, None]
        # What the output reads, side by side: readers [q exp(G) | P] times [S_in; vn], the
        # incoming state and the corrections stacked along the contraction (R = K + C).
        readers_MXCR = k.new_empty(M, X, C, K + C)
        torch.mul(q, exp_G[..., None], out=readers_MXCR[..., :K])
        torch.mul(_mm(q, _t(k)), decay, out=readers_MXCR[..., K:])
        read_MXRV = k.new_empty(M, X, K + C, V)
        S = state
        for m in range(M):
            read_MXRV[m, :, :K] = S
            vn = torch.baddbmm(u[m], w[m], S, alpha=-1)
            read_MXRV[m, :, K:] = vn
            S = torch.baddbmm(S * chunk_decay[m], _t(writers[m]), vn)
        out = _mm(readers_MXCR, read_MXRV)
        ctx.save_for_backward(q, k, v, beta, G, decay, kk, inverse, uw, readers_MXCR, read_MXRV)
        return out, S

    @staticmethod
    def backward(ctx, d_out, d_state):
        q, k, v, beta, G, decay, kk, inverse, uw, readers_MXCR, read_MXRV = ctx.saved_tensors
        M, X, C, K = k.shape
        V = v.shape[-1]
        exp_G = G.exp()
        exp_tail = (G[..., -1:] - G).exp()
        writers = k * exp_tail[..., None]
        chunk_decay = exp_G[..., -1, None, None]
        P, S_in, vn = readers_MXCR[..., K:], read_MXRV[:, :, :K], read_MXRV[:, :, K:]
        d_out = d_out.contiguous()
        # The output's share of each chunk's incoming dS and d_vn, batched over all chunks;
        # the reverse loop adds the share that flows back through the later states.
        d_read_MXRV = _mm(_t(readers_MXCR), d_out)
        d_S_out, d_vn_out = d_read_MXRV[:, :, :K], d_read_MXRV[:, :, K:]
        d_readers_MXCR = _mm(d_out, _t(read_MXRV))
        d_q_decayed, d_P = d_readers_MXCR[..., :K], d_readers_MXCR[..., K:]
        w = uw[..., V:]
        # d_uw = [d_vn, -(d_vn S_in^T)]: the loop writes d_vn into its first V columns.
        d_uw = k.new_empty(M, X, C, V + K)
        d_vn = d_uw[..., :V]
        d_states = S_in.new_empty(M + 1, X, K, V)  # d_states[m]: gradient of S_in[m]
        d_states[M] = 0 if d_state is None else d_state
        for m in range(M - 1, -1, -1):
            d_vn_m = torch.baddbmm(d_vn_out[m], writers[m], d_states[m + 1])
            d_vn[m] = d_vn_m
            incoming = torch.addcmul(d_S_out[m], d_states[m + 1], chunk_decay[m])
            torch.baddbmm(incoming, _t(w[m]), d_vn_m, alpha=-1, out=d_states[m])
        d_next = d_states[1:]

        d_writers = _mm(vn, _t(d_next))
        d_chunk_decay = torch.linalg.vecdot(S_in.flatten(-2), d_next.flatten(-2))
        # [u, w] = inverse [beta v, beta k exp(G)], and w reads the state: vn = u - w S.
        d_uw[..., V:] = _mm(d_vn, _t(S_in)).neg_()
        d_rhs = _mm(_t(inverse), d_uw)
        d_rhs_v, d_rhs_k = d_rhs[..., :V], d_rhs[..., V:]
        # d_L = -(d_rhs [u, w]^T) on the strict lower triangle; times D:
        d_L_decayed = _mm(d_rhs, _t(uw)).tril_(-1).mul_(decay).neg_()

        # L = beta_i (k k^T)_ij D_ij and P = (q k^T)_ij D_ij: their gradients to k k^T, q k^T,
        # and to the decays (H = dD * D, which feeds dG by rows minus columns).
        d_L_kk = d_L_decayed * kk
        d_kk = d_L_decayed.mul_(beta[..., None])
        d_qk = d_P * decay
        H = d_L_kk * beta[..., None]
        H.addcmul_(d_P, P)
        d_q = _mm(d_qk, k).addcmul_(d_q_decayed, exp_G[..., None])
        d_k = _mm(d_kk, k)
        _add_mm_(d_k, _t(d_kk), k)
        _add_mm_(d_k, _t(d_qk), q)
        d_k.addcmul_(d_writers, exp_tail[..., None]).addcmul_(d_rhs_k, (beta * exp_G)[..., None])
        d_v = d_rhs_v * beta[..., None]
        rhs_k_dot = torch.linalg.vecdot(d_rhs_k, k)
        d_beta = torch.linalg.vecdot(d_rhs_v, v) + rhs_k_dot * exp_G + d_L_kk.sum(-1)
        tail = torch.linalg.vecdot(d_writers, writers)
        d_G = H.sum(-1) - H.sum(-2) - tail
        d_G += (torch.linalg.vecdot(d_q_decayed, q) + rhs_k_dot * beta) * exp_G
        d_G[..., -1] += tail.sum(-1) + d_chunk_decay * exp_G[..., -1]
        # G is the in-chunk cumulative sum of g: g's gradient is the reverse cumulative sum.
        d_g = d_G.flip(-1).cumsum(-1).flip(-1)
        return d_q, d_k, d_v, d_g, d_beta, d_states[0] if ctx.needs_input_grad[5] else None
