"""The Gated DeltaNet's short causal depthwise convolution with its silu, channels last.

Shapes: B batch, T output positions, C channels, W = kernel - 1, H history inputs before the
first output position (0: zeros there; W: a carried conv state), X = H + T inputs, J = W + 1
taps.

out[b, t, c] = silu(sum_j weight[c, j] * inputs[b, t + H - W + j, c]), zero below index 0

Written as J shifted multiply-adds over [B, X, C] (the projection's own layout: no transposes,
no padded copy) in one autograd node: the input gradient is the same shifted sum run
backwards, the weight gradient J dot products along T. On CPU this is several times faster
than conv1d's depthwise backward on [B, C, T].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _tap_slices(*, j: int, W: int, H: int, T: int) -> tuple[slice, slice]:
    """(output positions, input positions) tap j joins: out[t] reads inputs[t + j - W + H]."""
    shift = j - W + H
    skip = max(0, -shift)  # leading outputs whose input would sit before index 0
    start = max(0, shift)
    return slice(skip, T), slice(start, start + T - skip)


class CausalConvSilu(torch.autograd.Function):
    """silu(causal depthwise conv): inputs_BXC [B, H + T, C], weight_CJ [C, W + 1], H (the
    leading inputs that are history, 0 <= H <= W) -> [B, T, C]."""

    @staticmethod
    def forward(ctx, inputs_BXC, weight_CJ, history):
        W = weight_CJ.shape[1] - 1
        T = inputs_BXC.shape[1] - history
        taps_JC = weight_CJ.t()
        out_slice, in_slice = _tap_slices(j=W, W=W, H=history, T=T)
        pre_BTC = inputs_BXC[:, in_slice] * taps_JC[W]  # the last tap covers every output
        for j in range(W):
            out_slice, in_slice = _tap_slices(j=j, W=W, H=history, T=T)
            pre_BTC[:, out_slice].addcmul_(inputs_BXC[:, in_slice], taps_JC[j])
        ctx.history = history
        ctx.save_for_backward(inputs_BXC, weight_CJ, pre_BTC)
        return F.silu(pre_BTC)

    @staticmethod
    def backward(ctx, d_out_BTC):
        inputs_BXC, weight_CJ, pre_BTC = ctx.saved_tensors
        W, H = weight_CJ.shape[1] - 1, ctx.history
        T = inputs_BXC.shape[1] - H
        taps_JC = weight_CJ.t()
        d_pre_BTC = torch.ops.aten.silu_backward(d_out_BTC, pre_BTC)
        d_inputs_BXC = torch.zeros_like(inputs_BXC) if H else None
        d_taps = []
        for j in range(W, -1, -1):
            out_slice, in_slice = _tap_slices(j=j, W=W, H=H, T=T)
            if d_inputs_BXC is None:  # no history: the last tap covers every input
                d_inputs_BXC = d_pre_BTC * taps_JC[j]
            else:
                d_inputs_BXC[:, in_slice].addcmul_(d_pre_BTC[:, out_slice], taps_JC[j])
            if ctx.needs_input_grad[1]:
                products_BC = torch.linalg.vecdot(
                    d_pre_BTC[:, out_slice], inputs_BXC[:, in_slice], dim=1
                )
                d_taps.append(products_BC.sum(0))
        d_weight_CJ = torch.stack(d_taps[::-1], dim=-1) if d_taps else None
        return d_inputs_BXC, d_weight_CJ, None
