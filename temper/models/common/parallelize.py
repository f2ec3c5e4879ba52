"""Parallelize a decoder (Qwen3, Llama 3, Qwen3-MoE): tensor parallel, activation checkpointing,
compile, FSDP2.

Applied in that order, to a model built on one device (model code stays single-device):

1. TP (tp > 1): in each block, q/k/v and gate/up split column-wise (by heads, by hidden
   width), o and down row-wise; the per-head q/k RMSNorms (Qwen3) see the local heads. Routed
   experts (MoE blocks) stay whole on every tp rank: splitting them is expert parallelism's
   job, not TP's. Embedding,
   block norms and unembedding stay whole on every tp rank (activations between sublayers are
   replicated), so the logprob code works on plain tensors and needs no vocabulary-parallel
   loss; the price is one full [V, D] unembedding per tp rank.
2. Activation checkpointing per block (recompute in backward).
3. `torch.compile` per block (opt-in: on CPU each new shape costs 10-40 s).
4. FSDP2 per block, then the root, over the data-parallel mesh (see temper/distributed/fsdp.py:
   gradients summed over ranks).

LoRA adapters must be applied before this (they become part of the sharded modules). LoRA
with TP is not supported yet: torch's row-wise style shards only `weight`/`bias`.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_module
from torch.distributed.device_mesh import DeviceMesh

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
from temper.models.lora import has_lora

# [B, T, N, H] activations: the heads are dimension 2.
_HEADS_DIM = 2


def decoder_tp_plan(block: nn.Module) -> dict:
    """Submodule name -> TP style for one block."""
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
    }
    if isinstance(block.feed_forward, SwiGLU):  # routed experts stay whole on each tp rank
        plan["feed_forward.w_gate"] = ColwiseParallel()
        plan["feed_forward.w_up"] = ColwiseParallel()
        plan["feed_forward.w_down"] = RowwiseParallel()
    if block.attention.q_norm is not None:
        plan["attention.q_norm"] = per_head_parallel(head_dim=_HEADS_DIM)
        plan["attention.k_norm"] = per_head_parallel(head_dim=_HEADS_DIM)
    return plan


def parallelize_decoder(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    mesh: DeviceMesh | None,
    activation_checkpointing: Literal["none", "full"] = "none",
    compile: bool = False,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
) -> nn.Module:
    """Shard `model` in place as `parallel_dims` says, over `mesh` (from
    `TrainerWorld.mesh`; None only when nothing is parallel). Returns the model.

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
        )
    return model


def _apply_tp(model: nn.Module, *, mesh: DeviceMesh, tp: int) -> None:
    for block in model.blocks:
        apply_tensor_parallel(block, mesh=mesh, plan=decoder_tp_plan(block))
        localize_heads(block.attention, attributes=("num_heads", "num_kv_heads"), tp=tp)


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else parse_dtype(name)
