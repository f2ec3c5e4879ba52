"""Parallelize a decoder (Qwen3, Llama 3, Qwen3-MoE, Qwen3.5): tensor parallel, expert
parallel, activation checkpointing, compile, FSDP2.

Applied in that order, to a model built on one device (model code stays single-device):

1. TP (tp > 1): in each block, q/k/v and gate/up split column-wise (by heads, by hidden
   width), o and down row-wise; the per-head q/k RMSNorms (Qwen3) see the local heads; a
   hybrid block's token mixer (gated attention or Gated DeltaNet) splits by heads as
   hybrid_parallel.py says. Routed
   experts (MoE blocks) stay whole on every tp rank: splitting them is expert parallelism's
   job, not TP's. Embedding,
   block norms and unembedding stay whole on every tp rank (activations between sublayers are
   replicated), so the logprob code works on plain tensors and needs no vocabulary-parallel
   loss; the price is one full [V, D] unembedding per tp rank.
2. EP (ep > 1): each MoE block's experts module (adapters included) is split over the ep
   ranks, tokens exchanged with all-to-all (temper/distributed/expert_parallel.py).
3. Activation checkpointing per block (recompute in backward).
4. `torch.compile` per block (opt-in: on CPU each new shape costs 10-40 s).
5. FSDP2 per block, then the root, over the data-parallel mesh (see temper/distributed/fsdp.py:
   gradients summed over ranks); expert-parallel experts first, each its own unit over the
   ranks that hold the same experts (efsdp, and dp_replicate).

LoRA adapters must be applied before this (they become part of the sharded modules). LoRA
with TP is not supported yet: torch's row-wise style shards only `weight`/`bias`.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_module
from torch.distributed.device_mesh import DeviceMesh

from temper.distributed.expert_parallel import apply_expert_parallel
from temper.distributed.fsdp import apply_fsdp
from temper.distributed.parallel_dims import ParallelDims
from temper.distributed.tensor_parallel import (
    ColwiseParallel,
    RowwiseParallel,
    apply_tensor_parallel,
    localize_heads,
    per_head_parallel,
)
from temper.models.build import parse_dtype
from temper.models.common.feed_forward import SwiGLU
from temper.models.common.hybrid_decoder import HybridBlock
from temper.models.common.hybrid_parallel import apply_hybrid_tp
from temper.models.common.moe import MoE
from temper.models.lora import has_lora

# [B, T, N, H] activations: the heads are dimension 2.
_HEADS_DIM = 2


def decoder_tp_plan(block: nn.Module) -> dict:
    """Submodule name -> TP style for one block (of a hybrid block, its feed-forward only:
    hybrid_parallel.py splits its token mixer)."""
    plan = {}
    if not _hybrid(block):
        plan["attention.wq"] = ColwiseParallel()
        plan["attention.wk"] = ColwiseParallel()
        plan["attention.wv"] = ColwiseParallel()
        plan["attention.wo"] = RowwiseParallel()
        if block.attention.q_norm is not None:
            plan["attention.q_norm"] = per_head_parallel(head_dim=_HEADS_DIM)
            plan["attention.k_norm"] = per_head_parallel(head_dim=_HEADS_DIM)
    if isinstance(block.feed_forward, SwiGLU):  # routed experts stay whole on each tp rank
        plan["feed_forward.w_gate"] = ColwiseParallel()
        plan["feed_forward.w_up"] = ColwiseParallel()
        plan["feed_forward.w_down"] = RowwiseParallel()
    return plan


def _hybrid(block: nn.Module) -> bool:
    """Whether `block` is a hybrid decoder's (Gated DeltaNet or gated attention mixer)."""
    return isinstance(block, HybridBlock)


def parallelize_decoder(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    mesh: DeviceMesh | None,
    expert_mesh: DeviceMesh | None = None,
    activation_checkpointing: Literal["none", "full"] = "none",
    compile: bool = False,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
) -> nn.Module:
    """Shard `model` in place as `parallel_dims` says, over `mesh` and, with ep > 1,
    `expert_mesh` (from `TrainerWorld.mesh`; None only when nothing is parallel). Returns the
    model.

    `param_dtype`/`reduce_dtype` ('float32', 'bfloat16' or None) set FSDP mixed precision.
    """
    parallel_dims.check_model(model.config)
    if parallel_dims.tp_enabled:
        if has_lora(model):
            raise ValueError(
                "ParallelDims.Config.tp > 1 with LoRA is not supported yet; use tp=1 "
                "(FSDP/DDP shard LoRA models) or full fine-tuning"
            )
        _apply_tp(model, mesh=mesh["tp"], tp=parallel_dims.tp)
    inner = []
    if parallel_dims.ep_enabled:
        assert expert_mesh is not None, "ep > 1 needs the expert mesh"
        expert_dp_mesh = parallel_dims.expert_dp_mesh(expert_mesh)
        for experts in _routed_experts(model):
            apply_expert_parallel(experts, mesh=expert_mesh["ep"])
            inner.append((experts, expert_dp_mesh))
    for block in model.blocks:
        if activation_checkpointing == "full":
            checkpoint_module(block)
        if compile:
            block.compile()
    if parallel_dims.dp_enabled:
        apply_fsdp(
            model,
            blocks=model.blocks,
            mesh=parallel_dims.dp_mesh(mesh),
            param_dtype=_dtype(param_dtype),
            reduce_dtype=_dtype(reduce_dtype),
            forward_methods=("hidden_states",),
            inner=inner,
        )
    return model


def _routed_experts(model: nn.Module) -> list[nn.Module]:
    """The experts module of every MoE block."""
    return [
        block.feed_forward.experts for block in model.blocks if isinstance(block.feed_forward, MoE)
    ]


def _apply_tp(model: nn.Module, *, mesh: DeviceMesh, tp: int) -> None:
    for block in model.blocks:
        if _hybrid(block):
            apply_hybrid_tp(block, mesh=mesh, tp=tp)
        else:
            localize_heads(block.attention, attributes=("num_heads", "num_kv_heads"), tp=tp)
        plan = decoder_tp_plan(block)
        if plan:
            apply_tensor_parallel(block, mesh=mesh, plan=plan)


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else parse_dtype(name)
