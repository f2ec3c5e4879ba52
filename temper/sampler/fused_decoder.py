"""Decode-time copies of a model's projections fused per layer (CPU, fp32).

Shapes: B rows, T tokens, D model dim, N query heads, K key/value heads, J = N + K, H head
dim, F feed-forward width.

A decode step on a small model is many small ops: per layer, three q/k/v projections, two
per-head norms and two rotations, then gate and up projections. A twin that holds
[wq; wk; wv] and [w_gate; w_up] as single matrices runs one matmul for each group, and
normalizes and rotates queries and keys together, in fewer and larger ops: about 9% less time
per decode step on the tiny model at 128 rows. Each output column of a fused matmul is the
same dot product as in the separate one, and the norm and rotation are applied per element
in the same order, so the results are bitwise those of the model's own forward (tested).

The fused weights are a copy of the attention and feed-forward projections (one pass over
them per weight version); every other tensor is the model's own. Like `PackedDecoder`, it
remembers the weights it copied and the engine rebuilds it after any change. Only plain
`nn.Linear` projections in fp32 are fused; a model with LoRA-wrapped projections or another
layout decodes on its own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from temper.models.common.attention import AttentionBackend, GroupedQueryAttention
from temper.models.common.decoder import Decoder
from temper.models.common.feed_forward import SwiGLU
from temper.models.common.rope import apply_rope, rope_cos_sin
from temper.sampler.packed_linear import fingerprint


def fusable(model: nn.Module) -> bool:
    """Whether `FusedDecoder` can stand in for this model's decode forward."""
    # Only the common Decoder's own forward is reproduced here (a family that changes it,
    # e.g. scaling embeddings, decodes on its own forward).
    if not isinstance(model, Decoder) or type(model).hidden_states is not Decoder.hidden_states:
        return False
    blocks = model.blocks
    for parameter in model.parameters():
        if parameter.dtype != torch.float32 or parameter.device.type != "cpu":
            return False
    for block in blocks:
        attention, feed_forward = block.attention, block.feed_forward
        if type(attention) is not GroupedQueryAttention or type(feed_forward) is not SwiGLU:
            return False
        linears = (attention.wq, attention.wk, attention.wv, attention.wo)
        linears += (feed_forward.w_gate, feed_forward.w_up, feed_forward.w_down)
        if any(type(linear) is not nn.Linear for linear in linears):
            return False
        if (attention.q_norm is None) != (attention.k_norm is None):
            return False
    return True


class _FusedLayer:
    def __init__(self, block: nn.Module) -> None:
        attention, feed_forward = block.attention, block.feed_forward
        self.block = block
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.head_dim = attention.head_dim
        projections = (attention.wq, attention.wk, attention.wv)
        self.w_qkv = torch.cat([p.weight.detach() for p in projections])
        self.b_qkv = None
        if attention.wq.bias is not None:
            self.b_qkv = torch.cat([p.bias.detach() for p in projections])
        self.qk_norm_weight_JH = None
        if attention.q_norm is not None:
            q_weight = attention.q_norm.weight.detach().expand(self.num_heads, -1)
            k_weight = attention.k_norm.weight.detach().expand(self.num_kv_heads, -1)
            self.qk_norm_weight_JH = torch.cat((q_weight, k_weight))
            self.qk_norm_eps = attention.q_norm.eps
        self.w_gate_up = torch.cat(
            (feed_forward.w_gate.weight.detach(), feed_forward.w_up.weight.detach())
        )
        self.ffn_dim = feed_forward.w_gate.weight.shape[0]

    def __call__(
        self,
        x_BTD: torch.Tensor,
        cos_B1TH: torch.Tensor,
        signed_sin_B1TH: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        block, layer = self.block, self.block.attention
        B, T, _ = x_BTD.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        qkv_BTX = F.linear(block.attention_norm(x_BTD), self.w_qkv, self.b_qkv)
        qk_BTJH = qkv_BTX[..., : (N + K) * H].view(B, T, N + K, H)
        if self.qk_norm_weight_JH is not None:
            # The per-head norms of queries and keys as one op: normalize, then each head's
            # weight (bitwise F.rms_norm with the weight, which scales after normalizing).
            normed_BTJH = F.rms_norm(qk_BTJH, (H,), None, self.qk_norm_eps)
            qk_BTJH = normed_BTJH * self.qk_norm_weight_JH
        qk_BJTH = apply_rope(qk_BTJH.transpose(1, 2), cos_B1TH, signed_sin_B1TH)
        v_BKTH = qkv_BTX[..., (N + K) * H :].view(B, T, K, H).transpose(1, 2)
        out_BNTH = attention.attend(layer.layer_index, qk_BJTH[:, :N], qk_BJTH[:, N:], v_BKTH)
        h_BTD = x_BTD + layer.wo(out_BNTH.transpose(1, 2).reshape(B, T, N * H))
        gate_up_BTX = F.linear(block.ffn_norm(h_BTD), self.w_gate_up)
        gate_BTF, up_BTF = gate_up_BTX[..., : self.ffn_dim], gate_up_BTX[..., self.ffn_dim :]
        return h_BTD + block.feed_forward.w_down(F.silu(gate_BTF) * up_BTF)


class FusedDecoder:
    """A model's decode forward (`hidden_states`, `logits`) on fused projection weights."""

    def __init__(self, model: nn.Module) -> None:
        if not fusable(model):
            raise ValueError("FusedDecoder needs fp32 CPU GroupedQueryAttention/SwiGLU blocks")
        self.model = model
        self._fingerprint = fingerprint(model)
        self._layers = [_FusedLayer(block) for block in model.blocks]

    def is_current_for(self, model: nn.Module) -> bool:
        """Whether this was built from `model` as its weights are now."""
        return model is self.model and fingerprint(model) == self._fingerprint

    def hidden_states(
        self, tokens_BT: torch.Tensor, *, positions_BT: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        model = self.model
        x_BTD = model.embed(tokens_BT)
        cos_B1TH, signed_sin_B1TH = rope_cos_sin(
            positions_BT,
            head_dim=model.config.head_dim,
            theta=model.config.rope_theta,
            dtype=x_BTD.dtype,
        )
        for layer in self._layers:
            x_BTD = layer(x_BTD, cos_B1TH, signed_sin_B1TH, attention)
        return model.norm(x_BTD)

    def logits(self, hidden_BD: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden_BD)
