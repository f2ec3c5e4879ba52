"""A decode-time twin of a hybrid model (Qwen3.5, dense and MoE): fused projections and the
Gated DeltaNet's one-token step written straight onto the recurrent-state pool (CPU).

Shapes: B rows, D model dim, C conv channels (q, k, v), W = conv kernel - 1, M key heads,
N value heads (G = N / M per key head), K key head dim, V value head dim, Q query heads, A
key/value heads of the full attention, H their head dim, X a fused projection's width.

A tiny hybrid model's decode step is a few hundred small ops: per Gated DeltaNet layer four
input projections, a convolution over a concatenated window, the delta rule's gathers and
reshapes, a state copy back into the pool. This twin runs the same arithmetic in fewer ops:
- in_proj_qkv and in_proj_z are one matmul, in_proj_b and in_proj_a another (fp32 GEMM
  rounds a 4-column product differently inside a wider one; an 8-column one alike), as are
  the full attention's q (with its gate), k and v, and SwiGLU's gate and up;
- the delta rule's state is decayed, read and updated in place in the pool's rows (the decode
  backend's views, `HybridDecode`), and the conv window is written back with one copy; the
  conv's taps are contiguous (vectorized multiply-adds, the same products and sums);
- queries and keys are repeated to the value heads and L2-normalized together;
- the norms' (1 + weight) scales and the decay's -exp(A_log) are computed once per twin.

Every elementwise op runs on the same values in the same order as the model's own recurrent
step (gated_deltanet.py, delta_rule.py): the same transcendental functions over the same
element counts in the same layouts (their vectorized and scalar paths can round differently),
and the same batched matmuls for the state's reads. The update's outer product k (beta
(v - read))^T is a single product per element however it is computed, so a broadcast
multiply stands in for the model's [K, 1] x [1, V] matmul. Each output column of a fused
projection is the dot product of the separate one. So the twin's logits are bitwise the
model's own decode step (tested in fp32, and in bf16 on packed weights).

Only the one-token step on the pool's rows (`HybridDecode`) is the twin's own; any other
forward runs the model's code. Like the dense twin (fused_decoder.py), it holds the weights as
they were when made: the CPU wing makes a new one after every `update_weights`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from temper.models.common.attention import AttentionBackend
from temper.models.common.decoder import Decoder
from temper.models.common.feed_forward import SwiGLU
from temper.models.common.gated_attention import GatedAttention, apply_partial_rope
from temper.models.common.gated_deltanet import GatedDeltaNet
from temper.models.common.hybrid_decoder import HybridBlock, HybridDecoder
from temper.models.common.moe import MoE
from temper.models.common.rope import rope_cos_sin
from temper.sampler.cpu.fused_decoder import (
    _feed_forward,
    _own_or_packed,
    _projection,
    packed_output,
)
from temper.sampler.hybrid_backends import HybridDecode


def hybrid_fusable(model: nn.Module) -> bool:
    """Whether `FusedHybridDecoder` can stand in for this model's decode forward."""
    if not isinstance(model, HybridDecoder):
        return False
    if type(model).hidden_states is not Decoder.hidden_states:
        return False
    dtypes = {parameter.dtype for parameter in model.parameters()}
    if len(dtypes) != 1 or dtypes.pop() not in (torch.float32, torch.bfloat16):
        return False
    if any(parameter.device.type != "cpu" for parameter in model.parameters()):
        return False
    for block in model.blocks:
        if type(block) is not HybridBlock:
            return False
        mixer = getattr(block, "linear_attention", None) or block.attention
        if type(mixer) is GatedDeltaNet:
            linears = (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a)
            linears += (mixer.out_proj,)
        elif type(mixer) is GatedAttention:
            linears = (mixer.wq, mixer.wk, mixer.wv, mixer.wo)
        else:
            return False
        feed_forward = block.feed_forward
        if type(feed_forward) is SwiGLU:
            linears += (feed_forward.w_gate, feed_forward.w_up, feed_forward.w_down)
        elif not isinstance(feed_forward, MoE):
            return False
        if any(type(linear) is not nn.Linear for linear in linears):
            return False
    return True


def _fused(linears: tuple[nn.Linear, ...], *, batch_hint: int | None):
    """One projection whose output is the linears' outputs side by side."""
    w_XD = torch.cat([linear.weight.detach() for linear in linears])
    b_X = None
    if linears[0].bias is not None:
        b_X = torch.cat([linear.bias.detach() for linear in linears])
    return _projection(w_XD, b_X, batch_hint=batch_hint)


def _normalize_fp32(x: torch.Tensor, *, eps: float) -> torch.Tensor:
    """centered_rmsnorm.py's normalization, op for op."""
    x_fp32 = x.float()
    return x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)


class _ZeroCenteredNorm:
    """A `ZeroCenteredRMSNorm` with its (1 + weight) computed once."""

    def __init__(self, norm: nn.Module) -> None:
        self.scale = 1.0 + norm.weight.detach().float()
        self.eps = norm.eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalize_fp32(x, eps=self.eps) * self.scale).to(x.dtype)


class _LinearAttentionLayer:
    """A Gated DeltaNet block's one-token step on the pool's rows."""

    def __init__(self, block: HybridBlock, *, batch_hint: int | None) -> None:
        mixer: GatedDeltaNet = block.linear_attention
        self.layer_index = mixer.layer_index
        self.attention_norm = _ZeroCenteredNorm(block.attention_norm)
        self.ffn_norm = _ZeroCenteredNorm(block.ffn_norm)
        self.M, self.N = mixer.num_key_heads, mixer.num_value_heads
        self.K, self.V = mixer.key_head_dim, mixer.value_head_dim
        self.C = mixer.conv_dim
        self.in_proj = _fused((mixer.in_proj_qkv, mixer.in_proj_z), batch_hint=batch_hint)
        self.gates_proj = _fused((mixer.in_proj_b, mixer.in_proj_a), batch_hint=batch_hint)
        self.taps_JC = mixer.conv_weight.detach()[:, 0].t().contiguous()
        self.neg_A_N = -mixer.A_log.detach().float().exp()
        self.dt_bias_N = mixer.dt_bias.detach()
        self.norm_weight_V = mixer.norm.weight.detach()
        self.norm_eps = mixer.norm.eps
        self.out_proj = _own_or_packed(mixer.out_proj, batch_hint=batch_hint)
        self.feed_forward = _feed_forward(block.feed_forward, batch_hint=batch_hint)

    def __call__(self, x_BD: torch.Tensor, states: HybridDecode) -> torch.Tensor:
        B = x_BD.shape[0]
        M, N, K, V, C = self.M, self.N, self.K, self.V, self.C
        conv_BCW, state_BNKV = states.read_states(self.layer_index)  # the pool's rows (views)
        normed_BD = self.attention_norm(x_BD)
        qkv_BC, z_BX = self.in_proj(normed_BD).split((C, N * V), dim=-1)
        b_BN, a_BN = self.gates_proj(normed_BD).split((N, N), dim=-1)
        # The conv over [its window; this input], then the window moves on by one.
        inputs_BJC = torch.cat((conv_BCW.transpose(1, 2).to(x_BD.dtype), qkv_BC[:, None]), 1)
        W = inputs_BJC.shape[1] - 1
        pre_BC = inputs_BJC[:, W] * self.taps_JC[W]
        for j in range(W):
            pre_BC.addcmul_(inputs_BJC[:, j], self.taps_JC[j])
        conv_BCW.copy_(inputs_BJC[:, 1:].transpose(1, 2))
        conv_BC = F.silu(pre_BC)
        # q and k repeated to the value heads ([2, B, N, K]), normalized together (fp32).
        qk_2BNK = conv_BC[:, : 2 * M * K].view(B, 2, M, K).transpose(0, 1)
        qk_2BNK = qk_2BNK.repeat_interleave(N // M, dim=2).float()
        qk_2BNK = qk_2BNK * torch.rsqrt((qk_2BNK * qk_2BNK).sum(dim=-1, keepdim=True) + 1e-6)
        q_BN1K = (qk_2BNK[0] * K**-0.5)[:, :, None]
        k_BN1K = qk_2BNK[1][:, :, None]
        v_BN1V = conv_BC[:, 2 * M * K :].reshape(B, N, 1, V).float()
        beta_BN11 = b_BN.contiguous().sigmoid().float()[:, :, None, None]
        g_BN = self.neg_A_N * F.softplus(a_BN.float() + self.dt_bias_N)
        # The delta rule's step, in place on the pool's state rows.
        state_BNKV.mul_(g_BN.exp()[:, :, None, None])
        delta_BN1V = (v_BN1V - k_BN1K @ state_BNKV) * beta_BN11
        state_BNKV.add_(k_BN1K.transpose(-1, -2) * delta_BN1V)
        out_BN1V = (q_BN1K @ state_BNKV).to(x_BD.dtype)
        # The gated RMSNorm (gate silu(z)), out_proj, then the feed-forward.
        z_BNV = z_BX.view(B, N, V)
        normalized_BNV = _normalize_fp32(out_BN1V[:, :, 0], eps=self.norm_eps).to(x_BD.dtype)
        normed_BNV = (self.norm_weight_V * normalized_BNV * F.silu(z_BNV.float())).to(x_BD.dtype)
        h_BD = x_BD + self.out_proj(normed_BNV.view(B, N * V))
        return h_BD + self.feed_forward(self.ffn_norm(h_BD))


class _FullAttentionLayer:
    """A gated full-attention block's step with q (and its gate), k and v as one matmul."""

    def __init__(self, block: HybridBlock, *, batch_hint: int | None) -> None:
        attention: GatedAttention = block.attention
        self.attention = attention
        self.attention_norm = _ZeroCenteredNorm(block.attention_norm)
        self.ffn_norm = _ZeroCenteredNorm(block.ffn_norm)
        self.q_norm = _ZeroCenteredNorm(attention.q_norm)
        self.k_norm = _ZeroCenteredNorm(attention.k_norm)
        self.qkv = _fused((attention.wq, attention.wk, attention.wv), batch_hint=batch_hint)
        self.wo = _own_or_packed(attention.wo, batch_hint=batch_hint)
        self.feed_forward = _feed_forward(block.feed_forward, batch_hint=batch_hint)

    def __call__(
        self,
        x_BD: torch.Tensor,
        cos_B1TR: torch.Tensor,
        signed_sin_B1TR: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        layer = self.attention
        B = x_BD.shape[0]
        Q, A, H = layer.num_heads, layer.num_kv_heads, layer.head_dim
        qkv_BX = self.qkv(self.attention_norm(x_BD))
        q_gate_BX, k_BX, v_BX = qkv_BX.split((2 * Q * H, A * H, A * H), dim=-1)
        q_B1QH, gate_B1QH = q_gate_BX.view(B, 1, Q, 2 * H).split(H, dim=-1)
        q_BQ1H = apply_partial_rope(self.q_norm(q_B1QH).transpose(1, 2), cos_B1TR, signed_sin_B1TR)
        k_BA1H = apply_partial_rope(
            self.k_norm(k_BX.view(B, 1, A, H)).transpose(1, 2), cos_B1TR, signed_sin_B1TR
        )
        v_BA1H = v_BX.view(B, 1, A, H).transpose(1, 2)
        out_BQ1H = backend.attend(layer.layer_index, q_BQ1H, k_BA1H, v_BA1H)
        out_BX = out_BQ1H.transpose(1, 2).reshape(B, 1, Q * H)
        gated_BX = out_BX * torch.sigmoid(gate_B1QH.reshape(B, 1, Q * H))
        h_BD = x_BD + self.wo(gated_BX)[:, 0]
        return h_BD + self.feed_forward(self.ffn_norm(h_BD))


class FusedHybridDecoder:
    """A hybrid model's decode forward (`hidden_states`, `logits`): one-token steps on fused
    projection weights (prepacked for about `batch_hint` rows when given); other forwards on
    the model itself."""

    def __init__(self, model: nn.Module, *, batch_hint: int | None = None) -> None:
        if not hybrid_fusable(model):
            raise ValueError(
                "FusedHybridDecoder needs a CPU hybrid decoder (Gated DeltaNet and gated "
                "attention blocks of plain linear layers) in fp32 or bf16"
            )
        self.model = model
        self._layers = [
            _LinearAttentionLayer(block, batch_hint=batch_hint)
            if block.layer_type == "linear_attention"
            else _FullAttentionLayer(block, batch_hint=batch_hint)
            for block in model.blocks
        ]
        self._output = packed_output(model, batch_hint=batch_hint)

    def hidden_states(
        self, tokens_BT: torch.Tensor, *, positions_BT: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        model = self.model
        if tokens_BT.shape[1] != 1 or not isinstance(attention, HybridDecode):
            return model.hidden_states(tokens_BT, positions_BT=positions_BT, attention=attention)
        x_BTD = model.embed(tokens_BT)
        cos_B1TR, signed_sin_B1TR = rope_cos_sin(
            positions_BT,
            head_dim=model.config.rotary_dim,
            theta=model.config.rope_theta,
            dtype=x_BTD.dtype,
            scaling=model.config.rope_scaling,
        )
        x_BD = x_BTD[:, 0]
        for layer in self._layers:
            if isinstance(layer, _LinearAttentionLayer):
                x_BD = layer(x_BD, attention)
            else:
                x_BD = layer(x_BD, cos_B1TR, signed_sin_B1TR, attention)
        return model.norm(x_BD[:, None])

    def logits(self, hidden_BD: torch.Tensor) -> torch.Tensor:
        if self._output is None:
            return self.model.logits(hidden_BD)
        return self._output(hidden_BD)
