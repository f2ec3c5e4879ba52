"""The Gated DeltaNet's short causal depthwise convolution with its silu, channels last.

Shapes: B batch, T output positions, C channels, W = kernel - 1, X = W + T inputs (the W before
the first output position: zeros or a carried conv state).

out[b, t, c] = silu(sum_j weight[c, j] * inputs[b, t + j, c]), j in [0, W]

Written as W + 1 shifted multiply-adds over [B, X, C] (the projection's own layout, so no
transposes) in one autograd node: the input gradient is the same shifted sum run backwards,
the weight gradient W + 1 dot products along T. On CPU this is several times faster than
conv1d's depthwise backward on [B, C, T], and it needs no transposes either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CausalConvSilu(torch.autograd.Function):
    """silu(causal depthwise conv): inputs_BXC [B, W + T, C], weight_CJ [C, W + 1] ->
    [B, T, C]."""

    @staticmethod
    def forward(ctx, inputs_BXC, weight_CJ):  # noqa: ANN001, ANN205 (autograd signature)
        W = weight_CJ.shape[1] - 1
        T = inputs_BXC.shape[1] - W
        taps_JC = weight_CJ.t()
        pre_BTC = inputs_BXC[:, W:] * taps_JC[W]
        for j in range(W):
            pre_BTC.addcmul_(inputs_BXC[:, j : j + T], taps_JC[j])
        ctx.save_for_backward(inputs_BXC, weight_CJ, pre_BTC)
        return F.silu(pre_BTC)

    @staticmethod
    def backward(ctx, d_out_BTC):  # noqa: ANN001, ANN205 (autograd signature)
        inputs_BXC, weight_CJ, pre_BTC = ctx.saved_tensors
        W = weight_CJ.shape[1] - 1
        T = inputs_BXC.shape[1] - W
        taps_JC = weight_CJ.t()
        d_pre_BTC = torch.ops.aten.silu_backward(d_out_BTC, pre_BTC)
        # Input x + j feeds output x through tap j: d_inputs[x] = sum_j tap_j * d_pre[x - j].
        d_pre_BXC = F.pad(d_pre_BTC, (0, 0, W, W))
        d_inputs_BXC = d_pre_BXC[:, W:] * taps_JC[0]
        for j in range(1, W + 1):
            d_inputs_BXC.addcmul_(d_pre_BXC[:, W - j : 2 * W - j + T], taps_JC[j])
        d_weight_CJ = None
        if ctx.needs_input_grad[1]:
            d_weight_CJ = torch.stack(
                [
                    torch.linalg.vecdot(d_pre_BTC, inputs_BXC[:, j : j + T], dim=1).sum(0)
                    for j in range(W + 1)
                ],
                dim=-1,
            )
        return d_inputs_BXC, d_weight_CJ
