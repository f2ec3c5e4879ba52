"""Decode-time copies of a model's projections fused per layer (CPU, fp32 or packed bf16).

Shapes: B rows, T tokens, D model dim, N query heads, K key/value heads, J = N + K, H head
dim, F feed-forward width.

A decode step on a small model is many small ops: per layer, three q/k/v projections, two
per-head norms and two rotations, then gate and up projections. A twin that holds
[wq; wk; wv] and [w_gate; w_up] as single matrices runs one matmul for each group, and
normalizes and rotates queries and keys together, in fewer and larger ops: about 9% less time
per decode step on the tiny model at 128 rows. Each output column of a fused matmul is the
same dot product as in the separate one, and the norm and rotation are applied per element
in the same order, so the results are bitwise those of the model's own forward (tested).

With `batch_hint` set (bf16 on CPU, see packed_linear.py) every projection and the output
layer read weights prepacked for oneDNN, as `PackedDecoder` does, and q/k/v are one packed
matrix: a bf16 decode step streams its weights, and oneDNN streams one [4096, 1024] matrix
about 30% faster than [2048, 1024] and two [1024, 1024] (measured on the 0.6B shape at 8
rows). Results are again bitwise those of the model's own forward (tested).

A MoE block (Qwen3-MoE's sparse layers) is not fused: its experts already run gate and up
as one matmul per expert, and its routing (router, softmax top-k, rows sorted by expert, the
outputs summed in top-k order) is the model's own code. So in a MoE model only attention is
fused and the block runs as it is, or on packed weights as its packed twin (router and every
expert's matrices packed, packed_linear.py), bitwise again.

The fused weights are a copy of the attention and feed-forward projections (one pass over
them per weights generation); every other tensor is the model's own. Like `PackedDecoder`,
it holds the weights as they were when it was made, and the CPU wing (decoding.py) makes a
new one after every `update_weights`. Only plain `nn.Linear` projections in fp32 or bf16 are
fused, beside SwiGLU or MoE feed-forwards; a model with LoRA-wrapped projections or another
layout decodes on its own forward (or the packed twin).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from temper.models.common.attention import AttentionBackend, GroupedQueryAttention
from temper.models.common.decoder import Decoder
from temper.models.common.feed_forward import SwiGLU
from temper.models.common.moe import GroupedExperts, MoE
from temper.models.common.rmsnorm import rms_normalize
from temper.models.common.rope import apply_rope, rope_cos_sin
from temper.sampler.cpu.packed_linear import PackedLinear, packed_twin

Projection = nn.Module | Callable[[torch.Tensor], torch.Tensor]


def fusable(model: nn.Module) -> bool:
    """Whether `FusedDecoder` can stand in for this model's decode forward."""
    # Only the common Decoder's own forward is reproduced here (a family that changes it,
    # e.g. scaling embeddings, decodes on its own forward).
    if not isinstance(model, Decoder) or type(model).hidden_states is not Decoder.hidden_states:
        return False
    if getattr(model.config, "linear_layers", ()):
        return False  # a hybrid model's blocks are not all grouped-query attention
    blocks = model.blocks
    dtypes = {parameter.dtype for parameter in model.parameters()}
    if len(dtypes) != 1 or dtypes.pop() not in (torch.float32, torch.bfloat16):
        return False
    if any(parameter.device.type != "cpu" for parameter in model.parameters()):
        return False
    for block in blocks:
        attention, feed_forward = block.attention, block.feed_forward
        if type(attention) is not GroupedQueryAttention:
            return False
        linears = (attention.wq, attention.wk, attention.wv, attention.wo)
        if type(feed_forward) is SwiGLU:
            linears += (feed_forward.w_gate, feed_forward.w_up, feed_forward.w_down)
        elif type(feed_forward) is MoE and type(feed_forward.experts) is GroupedExperts:
            linears += (feed_forward.router,)
        else:
            return False
        if any(type(linear) is not nn.Linear for linear in linears):
            return False
        if (attention.q_norm is None) != (attention.k_norm is None):
            return False
    return True


def _projection(
    weight: torch.Tensor, bias: torch.Tensor | None, *, batch_hint: int | None
) -> Projection:
    """x -> F.linear(x, weight, bias), on a prepacked copy of `weight` if `batch_hint`."""
    if batch_hint is not None:
        return PackedLinear(weight, bias=bias, batch_hint=batch_hint)
    return functools.partial(F.linear, weight=weight, bias=bias)


def _own_or_packed(linear: nn.Linear, *, batch_hint: int | None) -> Projection:
    """The model's own layer (no copy), or a packed copy of it."""
    if batch_hint is None:
        return linear
    return PackedLinear(linear.weight, bias=linear.bias, batch_hint=batch_hint)


def packed_output(model: Decoder, *, batch_hint: int | None) -> PackedLinear | None:
    """The output layer packed (the embedding when tied), or None: unpacked (no batch hint),
    or extended by an adapter (the model's own `logits` then applies it)."""
    if batch_hint is None or getattr(model, "output_adapter", None) is not None:
        return None
    return PackedLinear(model.output_weight_VD, batch_hint=batch_hint)


class _FusedLayer:
    def __init__(self, block: nn.Module, *, batch_hint: int | None) -> None:
        attention, feed_forward = block.attention, block.feed_forward
        self.block = block
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.head_dim = attention.head_dim
        projections = (attention.wq, attention.wk, attention.wv)
        w_qkv = torch.cat([p.weight.detach() for p in projections])
        b_qkv = None
        if attention.wq.bias is not None:
            b_qkv = torch.cat([p.bias.detach() for p in projections])
        self.qkv = _projection(w_qkv, b_qkv, batch_hint=batch_hint)
        self.wo = _own_or_packed(attention.wo, batch_hint=batch_hint)
        self.qk_norm_weight_JH = None
        if attention.q_norm is not None:
            q_weight = attention.q_norm.weight.detach().expand(self.num_heads, -1)
            k_weight = attention.k_norm.weight.detach().expand(self.num_kv_heads, -1)
            self.qk_norm_weight_JH = torch.cat((q_weight, k_weight))
            self.qk_norm_eps = attention.q_norm.eps
        self.feed_forward = _feed_forward(feed_forward, batch_hint=batch_hint)

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
        qkv_BTX = self.qkv(block.attention_norm(x_BTD))
        qk_BTJH = qkv_BTX[..., : (N + K) * H].view(B, T, N + K, H)
        if self.qk_norm_weight_JH is not None:
            # The per-head norms of queries and keys at once: normalize, then each head's
            # weight (bitwise RMSNorm: fp32 F.rms_norm with the weight scales after
            # normalizing; other dtypes normalize in fp32, cast back, then scale).
            if qk_BTJH.dtype == torch.float32:
                normed_BTJH = F.rms_norm(qk_BTJH, (H,), None, self.qk_norm_eps)
            else:
                normed_BTJH = rms_normalize(qk_BTJH, eps=self.qk_norm_eps)
            qk_BTJH = self.qk_norm_weight_JH * normed_BTJH
        qk_BJTH = apply_rope(qk_BTJH.transpose(1, 2), cos_B1TH, signed_sin_B1TH)
        v_BKTH = qkv_BTX[..., (N + K) * H :].view(B, T, K, H).transpose(1, 2)
        out_BNTH = attention.attend(layer.layer_index, qk_BJTH[:, :N], qk_BJTH[:, N:], v_BKTH)
        h_BTD = x_BTD + self.wo(out_BNTH.transpose(1, 2).reshape(B, T, N * H))
        return h_BTD + self.feed_forward(block.ffn_norm(h_BTD))


class _FusedSwiGLU:
    """A SwiGLU with its gate and up projections as one matrix."""

    def __init__(self, feed_forward: SwiGLU, *, batch_hint: int | None) -> None:
        w_gate_up = torch.cat(
            (feed_forward.w_gate.weight.detach(), feed_forward.w_up.weight.detach())
        )
        self.gate_up = _projection(w_gate_up, None, batch_hint=batch_hint)
        self.w_down = _own_or_packed(feed_forward.w_down, batch_hint=batch_hint)
        self.ffn_dim = feed_forward.w_gate.weight.shape[0]

    def __call__(self, x_BTD: torch.Tensor) -> torch.Tensor:
        gate_up_BTX = self.gate_up(x_BTD)
        gate_BTF, up_BTF = gate_up_BTX[..., : self.ffn_dim], gate_up_BTX[..., self.ffn_dim :]
        return self.w_down(F.silu(gate_BTF) * up_BTF)


def _feed_forward(feed_forward: nn.Module, *, batch_hint: int | None) -> Projection:
    """A block's feed-forward for the twin: a SwiGLU fused; a MoE block as it is (its routing
    and combining are the model's own code: the experts already run gate and up as one
    matmul per expert), or its packed twin (packed router and experts, packed_linear.py)."""
    if isinstance(feed_forward, SwiGLU):
        return _FusedSwiGLU(feed_forward, batch_hint=batch_hint)
    if batch_hint is None:
        return feed_forward
    return packed_twin(feed_forward, batch_hint=batch_hint)


class FusedDecoder:
    """A model's decode forward (`hidden_states`, `logits`) on fused projection weights,
    prepacked for about `batch_hint` rows when given."""

    def __init__(self, model: nn.Module, *, batch_hint: int | None = None) -> None:
        if not fusable(model):
            raise ValueError(
                "FusedDecoder needs CPU GroupedQueryAttention blocks with SwiGLU or MoE "
                "feed-forwards, in fp32 or bf16"
            )
        self.model = model
        self._layers = [_FusedLayer(block, batch_hint=batch_hint) for block in model.blocks]
        self._output = packed_output(model, batch_hint=batch_hint)

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
            scaling=model.config.rope_scaling,
        )
        for layer in self._layers:
            x_BTD = layer(x_BTD, cos_B1TH, signed_sin_B1TH, attention)
        return model.norm(x_BTD)

    def logits(self, hidden_BD: torch.Tensor) -> torch.Tensor:
        if self._output is None:
            return self.model.logits(hidden_BD)
        return self._output(hidden_BD)
