"""What autograd keeps per token for a hybrid (Qwen3.5) model's forward, term by term from its
config: the saved tensors of a Gated DeltaNet layer, of a gated full-attention layer, of the
zero-centred norms, and of the dense MLP or the routed plus shared experts. model_bytes.py's
`activation_bytes` adds them up for `temper plan` (tests/job/test_hybrid_activations.py pins
them against what autograd saves on tiny models).

Each term is a tensor's width per token times the bytes of the dtype the code keeps it in.
Three precisions decide those bytes:

- `weights`: the model's parameter dtype (fp32 for 'float32' and 'bf16-mixed' full
  fine-tuning; bf16 for 'bfloat16' and a 'bf16-mixed' LoRA base). The residual stream, each
  norm's output run in it.
- `compute`: a matmul's output (bf16 under autocast), and the Gated DeltaNet's conv (its
  weight cast to the projection's dtype) and what follows it up to out_proj.
- fp32 regardless: the norms' internals, the decay and its softplus, q and k normalized, the
  whole chunked delta rule (delta_rule_chunked.py saves q, k, v, beta, G, decay, kk, inverse,
  uw, readers and read, all fp32, autocast off), the gated norm's gate, the router's softmax.

Under autocast each linear that reads an fp32 tensor keeps its own bf16 cast of it; a bf16
tensor read by several linears is kept once. A frozen norm weight (LoRA) needs no saved
normalized input. Left out, each under 1%: the LoRA adapters' rank-wide intermediates, the
first block's input norm under LoRA (its input needs no gradient), per-call constants
(autocast's weight casts are `autocast_copy_bytes`), and the delta rule's padding of each
sequence to whole chunks of `CHUNK` tokens (a sequence shorter than a chunk runs a smaller
one, so the estimate is an upper bound there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from temper.models.build import parse_dtype
from temper.models.common.delta_rule import DEFAULT_CHUNK_SIZE
from temper.models.common.hybrid_decoder import LINEAR_ATTENTION, HybridDecoderConfig
from temper.models.common.moe_decoder import MoEDecoderConfig

CHUNK = DEFAULT_CHUNK_SIZE
"""Tokens per chunk of the delta rule (its [C, C] decay, kk and inverse per token and head)."""
FP32 = 4
INDEX = 8
"""An int64 index."""


@dataclass(frozen=True, kw_only=True)
class _Bytes:
    """Bytes per element of what a forward keeps, for one precision (see the module doc)."""

    weights: int
    compute: int
    autocast: bool
    lora: bool

    @classmethod
    def of(cls, *, dtype: str, lora: bool) -> _Bytes:
        if dtype == "bf16-mixed":
            return cls(weights=2 if lora else FP32, compute=2, autocast=True, lora=lora)
        size = parse_dtype(dtype).itemsize
        return cls(weights=size, compute=size, autocast=False, lora=lora)

    def inputs(self, width: int, *, readers: int) -> int:
        """A `width`-wide tensor in the weights' dtype read by `readers` linears: under
        autocast an fp32 one is cast by each (bf16 copies), else it is kept once."""
        if self.autocast and self.weights == FP32:
            return readers * self.compute * width
        return self.weights * width

    def norm(self, width: int) -> int:
        """A zero-centred RMSNorm over `width` (per row: its fp32 input, the fp32 inverse
        root, and without LoRA the fp32 normalized input the weight's gradient reads)."""
        return FP32 * width + FP32 + (0 if self.lora else FP32 * width)


def linear_attention_bytes(config: HybridDecoderConfig, precision: _Bytes) -> int:
    """A Gated DeltaNet mixer's saved bytes per token (gated_deltanet.py)."""
    p, dim = precision, config.dim
    heads, key_heads = config.linear_num_value_heads, config.linear_num_key_heads
    K, V, C = config.linear_key_head_dim, config.linear_value_head_dim, CHUNK
    value_dim, conv_dim = heads * V, config.conv_dim
    projections = p.inputs(dim, readers=4)  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    # The conv's input and pre-silu output: its weight is cast to the projection's dtype.
    conv = 2 * conv_dim * p.compute
    # beta = sigmoid(b); softplus's input, and its output the A_log gradient reads.
    gates = heads * p.compute + FP32 * heads * (1 if p.lora else 2)
    # q and k normalized in fp32: the conv's output itself when fp32 (q and k are views of
    # it), else fp32 copies of q and k; and their inverse norms.
    normalized = FP32 * (conv_dim if p.compute == FP32 else 2 * key_heads * K)
    normalized += FP32 * 2 * key_heads
    # Per value head and token: q, k (repeated to the value heads: a copy, except with one
    # key head in a one-row batch), v, beta, G, decay/kk/inverse (C each), uw, readers
    # [q exp(G) | P], read [S_in; vn] ((K + C) x V a chunk).
    rule = FP32 * heads * (4 * K + 3 * V + 4 * C + 2 + K * V / C)
    # Gated RMSNorm: fp32 input, inverse norms, gate and silu(gate); the weighted product
    # (and without LoRA the normalized input) in the rule's output dtype, the compute one.
    gated_norm = FP32 * (3 * value_dim + heads) + value_dim * p.compute
    gated_norm += 0 if p.lora else value_dim * p.compute
    out_proj = p.inputs(value_dim, readers=1)
    return round(projections + conv + gates + normalized + rule + gated_norm + out_proj)


def full_attention_bytes(config: HybridDecoderConfig, precision: _Bytes) -> int:
    """A gated full-attention mixer's saved bytes per token (gated_attention.py; the rotary
    tables are the model's, `model_bytes_per_token`)."""
    p = precision
    query, key = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    projections = p.inputs(config.dim, readers=3)  # wq, wk, wv
    # q/k norms: fp32 inputs (an fp32 wq output is kept whole, gate half included), inverse
    # norms, and without LoRA the normalized inputs.
    norms = FP32 * (query + key + config.num_heads + config.num_kv_heads)
    norms += query * p.compute if p.compute == FP32 else 0
    norms += 0 if p.lora else FP32 * (query + key)
    # SDPA keeps q, k, v, its output and the fp32 log-sum-exp per query head.
    attention = p.compute * (2 * query + 2 * key) + FP32 * config.num_heads
    # The output gate: the attention output and sigmoid(gate); wo reads their product.
    gate = 3 * query * p.compute
    return projections + norms + attention + gate


def feed_forward_bytes(config: HybridDecoderConfig, precision: _Bytes, *, sparse: bool) -> float:
    """A dense SwiGLU's saved bytes per token, or a sparse layer's routed experts, router and
    shared expert with its sigmoid gate (shared_expert_moe.py)."""
    p = precision
    # SwiGLU: gate (silu's input), silu(gate), up and their product (down's input).
    swiglu = 4 * config.ffn_dim * p.compute
    if not sparse:
        return p.inputs(config.dim, readers=2) + swiglu
    assert isinstance(config, MoEDecoderConfig)
    k = config.top_k
    # Read by the shared expert's gate, gate and up, and the router.
    inputs = p.inputs(config.dim, readers=4)
    shared = swiglu + p.compute * (1 + config.dim)  # sigmoid(gate) and the shared output
    # The routed experts (sliced_experts.py): each assignment's row, gate and up, and their
    # activations (with expert LoRA also silu(gate) and the product apart), and its weight.
    width = (5 if p.lora else 3) * config.moe_ffn_dim
    experts = k * (config.dim + width + 1) * p.compute
    # The router: fp32 softmax over all experts and the top-k renormalization's sum; per
    # assignment its expert, place and token indices and sort order, and its fp32 weight.
    router = FP32 * (config.num_experts + 1) + k * (4 * INDEX + FP32)
    return inputs + shared + experts + router


def hybrid_layer_bytes(config: HybridDecoderConfig, *, dtype: str, lora: bool) -> list[float]:
    """Each layer's saved bytes per token: its two norms, its token mixer and its
    feed-forward. `dtype`: the model's, or 'bf16-mixed' (fp32 weights under bf16
    autocast)."""
    p = _Bytes.of(dtype=dtype, lora=lora)
    linear, full = linear_attention_bytes(config, p), full_attention_bytes(config, p)
    layers = []
    for index, kind in enumerate(config.layer_types):
        sparse = isinstance(config, MoEDecoderConfig) and config.is_sparse(index)
        mixer = linear if kind == LINEAR_ATTENTION else full
        layers.append(2 * p.norm(config.dim) + mixer + feed_forward_bytes(config, p, sparse=sparse))
    return layers


def model_bytes_per_token(config: HybridDecoderConfig, *, dtype: str, lora: bool) -> int:
    """What the model keeps per token outside its blocks: the final norm, the token ids the
    embedding's gradient reads (a trained embedding only) and, with full-attention layers,
    the rotary cos and sin tables all of them read."""
    p = _Bytes.of(dtype=dtype, lora=lora)
    rotary = 2 * config.rotary_dim * p.weights if config.attention_layers else 0
    return p.norm(config.dim) + (0 if lora else INDEX) + rotary


def block_input_bytes(config: HybridDecoderConfig, *, dtype: str, lora: bool) -> int:
    """A block's input per token (what full activation checkpointing keeps of each block):
    the residual stream, in the weights' dtype."""
    return config.dim * _Bytes.of(dtype=dtype, lora=lora).weights


def hybrid_activation_bytes(
    config: HybridDecoderConfig,
    *,
    tokens: int,
    dtype: str,
    lora: bool,
    checkpointing: Literal["none", "full"],
) -> int:
    """`activation_bytes` of a hybrid model: every block's saved tensors, or with full
    checkpointing every block's input plus the largest block's saved tensors (recomputed in
    backward), and what the model keeps outside its blocks."""
    layers = hybrid_layer_bytes(config, dtype=dtype, lora=lora)
    if checkpointing == "full":
        per_token = config.num_layers * block_input_bytes(config, dtype=dtype, lora=lora) + max(
            layers
        )
    else:
        per_token = sum(layers)
    return math.ceil(tokens * (per_token + model_bytes_per_token(config, dtype=dtype, lora=lora)))
