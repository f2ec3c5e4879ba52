"""What a model's tensors take, from its config alone: parameter shapes of the trainer (LoRA
applied) and of the generator's merged copy, FSDP shards, what a trainer holds of them
(weights, gradients, AdamW moments), what one of Temper's engines holds (weights, KV cache,
prefix cache), and an estimate of the activations autograd keeps. memory_plan.py adds them up
per rank for `temper plan` and a job's startup log; the server counts its models with them
(server/state/base_models.py).

Shapes come from a model built on the meta device (nothing is allocated), so they are the
model code's own, LoRA targets and the untying of a merged tied unembedding included. A MoE
model's routed experts are stacked parameters ([E, ...]) that FSDP shards on the expert
dimension like any other dim 0 (with expert parallelism: split into `ep` parts first, each
part FSDP-sharded over the shard ranks / ep); `ModelShapes` tells them apart
(`experts=True`), and the activations of a sparse layer follow its top_k experts' width, not
`ffn_dim`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from temper.job.hybrid_activations import hybrid_activation_bytes
from temper.models.build import materialize, parse_dtype
from temper.models.common.decoder import DecoderConfig
from temper.models.common.hybrid_decoder import HybridDecoderConfig
from temper.models.common.logprobs import DEFAULT_CHUNK_BYTES
from temper.models.common.moe_decoder import MoEDecoderConfig
from temper.models.lora import (
    LORA_SUFFIXES,
    LoraConfig,
    LoraUnembedding,
    adapted_key,
    apply_lora,
    lora_modules,
    merged_config,
)
from temper.sampler.engine import SamplerEngine
from temper.sampler.kv_cache import KVCacheShape
from temper.sampler.recurrent_pool import RecurrentPoolShape


@dataclass(frozen=True, kw_only=True)
class ModelShapes:
    """Parameter shapes of the trainer's model (LoRA applied) and what they imply; read from
    a model built on the meta device, so nothing is allocated."""

    trainer: tuple[tuple[str, tuple[int, ...], bool], ...]
    """(name, shape, trainable) of every parameter of the trainer's model."""
    sampler_numel: int
    """Elements of the generator's plain (merged) model."""
    adapted_numel: int
    """Elements of all the weights LoRA adapts (0 without LoRA)."""
    largest_adapted_numel: int
    """Elements of the largest weight LoRA adapts (what a merge upcasts to fp32 at once)."""

    @classmethod
    def of(cls, decoder: DecoderConfig, *, lora_rank: int | None) -> ModelShapes:
        model = materialize(decoder, device="meta", dtype=torch.float32, init="empty")
        untied = 0
        adapted: list[int] = []
        if lora_rank is not None:
            # Rank 1 on meta, then the rank-R shapes: A is [R, in] and B [out, R] (with a
            # leading expert dimension for expert adapters).
            apply_lora(model, LoraConfig(rank=1))
            if not merged_config(model).tie_embeddings and decoder.tie_embeddings:
                untied = decoder.vocab_size * decoder.dim  # merging unties the output
            adapted = [
                _adapted_weight(model, name, module).numel()
                for name, module in lora_modules(model).items()
            ]
        trainer = tuple(
            (name, _at_rank(name, tuple(parameter.shape), lora_rank), parameter.requires_grad)
            for name, parameter in model.named_parameters()
        )
        base = [math.prod(shape) for name, shape, _ in trainer if not name.endswith(LORA_SUFFIXES)]
        return cls(
            trainer=trainer,
            sampler_numel=sum(base) + untied,
            adapted_numel=sum(adapted),
            largest_adapted_numel=max(adapted, default=0),
        )

    def with_lora_rank(self, rank: int) -> ModelShapes:
        """These shapes with the LoRA adapters at rank `rank` (the sampler's are unchanged:
        it holds merged weights)."""
        trainer = tuple(
            (name, _at_rank(name, shape, rank), trained) for name, shape, trained in self.trainer
        )
        return dataclasses.replace(self, trainer=trainer)

    def shard_numel(
        self,
        num_ranks: int,
        *,
        trainable: bool | None = None,
        experts: bool | None = None,
        ep: int = 1,
    ) -> int:
        """Elements one rank holds of the parameters (`trainable` ones, frozen ones, or all
        with None; those of routed experts, the others, or all with `experts` None) sharded
        on dim 0 over `num_ranks` (FSDP2 pads to ceil(dim0 / ranks)); with expert parallelism
        (`ep` > 1) the experts' E / ep of a rank's ep part over num_ranks / ep."""
        return sum(
            _shard_numel(shape, num_ranks, ep=ep if is_expert(name) else 1)
            for name, shape, is_trainable in self.trainer
            if (trainable is None or is_trainable == trainable)
            and (experts is None or is_expert(name) == experts)
        )

    @property
    def expert_numel(self) -> int:
        """Elements of the routed experts' weights (0 for a dense model): every expert of
        every sparse layer, as the trainer's base and the generator's plain model hold them."""
        return sum(
            math.prod(shape)
            for name, shape, _ in self.trainer
            if is_expert(name) and not name.endswith(LORA_SUFFIXES)
        )

    @property
    def largest_block_numel(self) -> int:
        """Elements of the largest block (what FSDP gathers for one block): a MoE model's
        sparse blocks outweigh its dense ones."""
        return self.gathered_block_numel(ep=1)

    def gathered_block_numel(self, *, ep: int) -> int:
        """Elements FSDP gathers to run the largest block: all of it, but with expert
        parallelism only 1 / ep of a sparse block's experts (the rank's ep part)."""
        blocks: dict[str, int] = {}
        for name, shape, _ in self.trainer:
            if name.startswith("blocks."):
                index = name.split(".")[1]
                numel = math.prod(shape) // (ep if is_expert(name) else 1)
                blocks[index] = blocks.get(index, 0) + numel
        return max(blocks.values())

    def numel(self, *, prefix: str = "", root: bool = False) -> int:
        """Elements of the parameters under `prefix` ('blocks.0.'), or with `root` of those
        outside the blocks (embedding, output, final norm)."""
        return sum(
            math.prod(shape)
            for name, shape, _ in self.trainer
            if (not name.startswith("blocks.") if root else name.startswith(prefix))
        )


@dataclass(frozen=True, kw_only=True)
class TrainerBytes:
    """What one trainer rank holds of its model between steps: the weights, and for the
    trained ones their gradients and AdamW's two moments, in the trainer's parameter dtype
    (fp32 under 'bf16-mixed': the master weights, with a frozen LoRA base in bf16; bf16 under
    pure 'bfloat16', which has no master copy)."""

    frozen: int
    """Weights that are not trained (a LoRA model's base)."""
    trained: int
    """Weights that are trained: every weight for full fine-tuning, else the adapters."""

    @classmethod
    def of(
        cls,
        shapes: ModelShapes,
        *,
        dtype: str,
        num_ranks: int = 1,
        frozen_dtype: str | None = None,
        ep: int = 1,
    ) -> TrainerBytes:
        """One rank's share of `shapes` sharded over `num_ranks` (FSDP2's padded shards; the
        experts split `ep` ways first), the trained weights in `dtype`, the frozen ones in
        `frozen_dtype` (None: `dtype`)."""
        frozen_size = parse_dtype(frozen_dtype or dtype).itemsize
        frozen = shapes.shard_numel(num_ranks, trainable=False, ep=ep)
        trained = shapes.shard_numel(num_ranks, trainable=True, ep=ep)
        return cls(frozen=frozen * frozen_size, trained=trained * parse_dtype(dtype).itemsize)

    @property
    def weights(self) -> int:
        return self.frozen + self.trained

    @property
    def gradients(self) -> int:
        return self.trained

    @property
    def moments(self) -> int:
        """AdamW's exp_avg and exp_avg_sq."""
        return 2 * self.trained

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.moments


@dataclass(frozen=True, kw_only=True)
class SamplerBytes:
    """What one of Temper's engines holds: its weights (none when it decodes on the trainer's
    own tensors), the KV cache it allocates up front (a hybrid model's full-attention layers
    only), a hybrid model's recurrent-state pool (allocated with it, the same at any sequence
    length) and at most its prefix cache."""

    weights: int
    kv_cache: int
    prefix_cache: int
    recurrent_states: int = 0

    @classmethod
    def of(
        cls,
        decoder: DecoderConfig,
        shapes: ModelShapes,
        *,
        num_slots: int,
        max_seq_len: int,
        dtype: str,
        prefix_cache_mib: float,
        tp: int = 1,
        own_weights: bool = True,
    ) -> SamplerBytes:
        """An engine on `shapes`' plain (merged) model with `num_slots` x `max_seq_len` KV
        positions; with tensor parallelism one rank's share (1/tp of the weights)."""
        weights = math.ceil(shapes.sampler_numel * parse_dtype(dtype).itemsize / tp)
        kv = kv_cache_bytes(
            decoder, num_slots=num_slots, max_seq_len=max_seq_len, dtype=dtype, tp=tp
        )
        return cls(
            weights=weights if own_weights else 0,
            kv_cache=kv,
            prefix_cache=int(prefix_cache_mib * 2**20),
            recurrent_states=recurrent_state_bytes(
                decoder, num_slots=num_slots, dtype=dtype, tp=tp
            ),
        )

    @classmethod
    def of_engine(
        cls,
        decoder: DecoderConfig,
        shapes: ModelShapes,
        *,
        engine: SamplerEngine.Config,
        dtype: str,
        own_weights: bool = True,
    ) -> SamplerBytes:
        """An engine built from `engine` (its max_batch slots, its max_seq_len cut to the
        model's)."""
        return cls.of(
            decoder,
            shapes,
            num_slots=engine.max_batch,
            max_seq_len=min(engine.max_seq_len, decoder.max_seq_len),
            dtype=dtype,
            prefix_cache_mib=engine.prefix_cache_mib,
            own_weights=own_weights,
        )

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.recurrent_states + self.prefix_cache


def _adapted_weight(model: nn.Module, name: str, module: nn.Module) -> torch.Tensor:
    if isinstance(module, LoraUnembedding):
        return model.output_weight_VD
    return model.get_parameter(adapted_key(name, module))


def _at_rank(name: str, shape: tuple[int, ...], rank: int | None) -> tuple[int, ...]:
    if name.endswith(".lora_A"):
        return (*shape[:-2], rank, shape[-1])
    if name.endswith(".lora_B"):
        return (*shape[:-1], rank)
    return shape


def _shard_numel(shape: tuple[int, ...], num_ranks: int, *, ep: int) -> int:
    """One rank's padded FSDP shard; with ep > 1 of its ep part (dim 0 / ep rows) over the
    num_ranks / ep ranks that hold the same part."""
    return math.ceil(shape[0] // ep / (num_ranks // ep)) * math.prod(shape[1:])


def is_expert(name: str) -> bool:
    """Whether a parameter belongs to a MoE block's routed experts (not its router)."""
    return ".feed_forward.experts." in name


def num_active_params(decoder: DecoderConfig) -> int:
    """Parameters one token uses: every parameter of a dense model; a MoE model's top_k of
    its experts in each sparse layer, and the rest."""
    if not isinstance(decoder, MoEDecoderConfig):
        return decoder.num_params
    unused = decoder.expert_params // decoder.num_experts * (decoder.num_experts - decoder.top_k)
    return decoder.num_params - unused


# Elements autograd saves per token and layer, as coefficients of (D, N*H + K*H, F), keyed
# by (the model is fp32, LoRA). Measured on this model code by counting saved tensors; in bf16 each
# RMSNorm also keeps its input in fp32, and a frozen norm weight needs no saved output.
_SAVED_PER_TOKEN_LAYER = {
    (False, False): (8, 5, 4),
    (False, True): (6, 4, 4),
    (True, False): (6, 4, 4),
    (True, True): (4, 3, 4),
}
# Under bf16 autocast ('bf16-mixed': fp32 trained weights, a LoRA base in bf16) the saved
# tensors mix bf16 (matmul inputs) and fp32 (the residual stream, norm inputs): bytes, not
# elements, per token and layer, keyed by LoRA; measured on CPU autocast the same way
# (tests/job/test_memory_plan.py).
_MIXED_SAVED_BYTES_PER_TOKEN_LAYER = {False: (21.5, 10.5, 8), True: (9, 8.5, 8)}
# A sparse layer's routed experts save, per token, in place of a dense layer's F term: the
# top_k rows sent to the experts (K x D elements; the summed outputs keep only indices), gate
# and up and their product (3 x K x F elements of the expert width), the router's fp32 softmax
# (4 bytes per expert) and, per assignment, its expert, its place in the sorted rows and its
# weight (about 40 bytes). The elements are the experts' compute dtype: the model's, bf16
# under 'bf16-mixed' (the experts cast their rows and weights as autocast casts a linear's).
# A sparse layer also keeps one D-wide input fewer than the dense layer the D coefficients
# were measured on: with LoRA the MLP adapters' input (frozen experts and router keep none;
# bf16 under 'bf16-mixed'), and in 'bf16-mixed' full fine-tuning one of the bf16 casts of the
# MLP's fp32 input (gate and up cast it each, the router once). Measured the same way on the
# per-expert path (tests/job/test_memory_plan_moe.py); the grouped kernel on CUDA keeps more
# through autograd (its gate, up and product as separate tensors, and the output rows).
_EXPERT_ROWS_PER_TOKEN, _EXPERT_WIDTH_PER_TOKEN = 1, 3
_ROUTER_BYTES_PER_EXPERT, _BYTES_PER_ASSIGNMENT = 4, 40


def activation_bytes(
    decoder: DecoderConfig,
    *,
    tokens: int,
    dtype: str,
    lora: bool,
    checkpointing: Literal["none", "full"],
) -> int:
    """Estimated bytes autograd keeps for a forward over `tokens` tokens (without the logits
    and, under 'bf16-mixed', without autocast's copies of the weights: `autocast_copy_bytes`):
    every block's saved tensors, or with checkpointing every block's input plus the largest
    block's saved tensors (recomputed in backward), and the final norm's. `dtype`: the
    model's, or 'bf16-mixed' (fp32 weights under bf16 autocast). A hybrid model's layers are
    counted term by term from its config (hybrid_activations.py)."""
    if isinstance(decoder, HybridDecoderConfig):
        return hybrid_activation_bytes(
            decoder, tokens=tokens, dtype=dtype, lora=lora, checkpointing=checkpointing
        )
    if dtype == "bf16-mixed":
        # Coefficients in bytes. A block's input is the residual stream: fp32 after an fp32
        # embedding, bf16 after a LoRA base's bf16 one.
        element, block_input = 1, 2 if lora else 4
        d, qkv, f = _MIXED_SAVED_BYTES_PER_TOKEN_LAYER[lora]
    else:
        element, block_input = parse_dtype(dtype).itemsize, 1
        d, qkv, f = _SAVED_PER_TOKEN_LAYER[(parse_dtype(dtype) == torch.float32, lora)]
    attention = (decoder.num_heads + decoder.num_kv_heads) * decoder.head_dim
    shared = (d * decoder.dim + qkv * attention) * element
    dense = shared + f * decoder.ffn_dim * element
    layers = [
        shared + _expert_bytes_per_token(decoder, dtype=dtype, lora=lora)
        if _is_sparse(decoder, index)
        else dense
        for index in range(decoder.num_layers)
    ]
    if checkpointing == "full":
        per_token = decoder.num_layers * decoder.dim * block_input * element + max(layers)
    else:
        per_token = sum(layers)
    return math.ceil(tokens * (per_token + d * decoder.dim * element))


def _is_sparse(decoder: DecoderConfig, layer_index: int) -> bool:
    return isinstance(decoder, MoEDecoderConfig) and decoder.is_sparse(layer_index)


def _expert_bytes_per_token(decoder: MoEDecoderConfig, *, dtype: str, lora: bool) -> float:
    """What a sparse layer's routed experts and router save per token (see above)."""
    if dtype == "bf16-mixed":
        element = fewer_input = 2
    else:
        element = parse_dtype(dtype).itemsize
        fewer_input = element if lora else 0
    k = decoder.top_k
    rows = _EXPERT_ROWS_PER_TOKEN * k * decoder.dim
    width = _EXPERT_WIDTH_PER_TOKEN * k * decoder.moe_ffn_dim
    router = _ROUTER_BYTES_PER_EXPERT * decoder.num_experts
    return (rows + width) * element + router + _BYTES_PER_ASSIGNMENT * k - fewer_input * decoder.dim


def autocast_copy_bytes(shapes: ModelShapes, *, dtype: str) -> int:
    """What autocast keeps of the weights during an unsharded mixed-precision step: each
    fp32 (trained) weight a matmul reads, cast once to the compute `dtype` and saved for
    backward (every trained parameter counted: the norms' weights, which are not cast, are a
    rounding error); a LoRA base is in the compute dtype already."""
    return shapes.shard_numel(1, trainable=True) * parse_dtype(dtype).itemsize


def logits_bytes(decoder: DecoderConfig, *, tokens: int) -> int:
    """The fp32 logits of one chunk of rows and their log-softmax (logprobs.py)."""
    return 2 * min(DEFAULT_CHUNK_BYTES, tokens * decoder.vocab_size * 4)


def recurrent_state_bytes(
    decoder: DecoderConfig, *, num_slots: int, dtype: str, tp: int = 1
) -> int:
    """What Temper's engine preallocates for a hybrid model's linear-attention layers
    (recurrent_pool.py: per slot and layer a conv state in `dtype` and a delta-rule state in
    fp32); 0 for a dense model. With tensor parallelism each rank holds 1/tp of the heads."""
    shape = RecurrentPoolShape.for_model(decoder, num_slots=num_slots)
    return 0 if shape is None else math.ceil(shape.nbytes(parse_dtype(dtype)) / tp)


def kv_cache_bytes(
    decoder: DecoderConfig, *, num_slots: int, max_seq_len: int, dtype: str, tp: int = 1
) -> int:
    """What Temper's engine preallocates (kv_cache.py); with tensor parallelism each rank
    holds num_kv_heads / tp heads (at least one)."""
    shape = KVCacheShape.for_model(decoder, num_slots=num_slots, max_seq_len=max_seq_len)
    shape = dataclasses.replace(shape, num_kv_heads=max(1, decoder.num_kv_heads // tp))
    return shape.nbytes(parse_dtype(dtype))
