"""Tensor parallelism for the hybrid decoder's blocks (Qwen3.5): heads split over the tp ranks
in both kinds of token mixer.

Shapes: D model dim, C conv channels (q, k, v side by side), M key heads, N value heads, K key
head dim, V value head dim, H attention head dim.

Gated full attention: `wq` [N * 2H, D] holds each head's query and gate side by side, head
after head, so a column-wise split gives each rank whole heads with their gates; k and v split
by key/value heads, o row-wise, the per-head q/k norms see the local heads (as the dense plan).

Gated DeltaNet, rank r of tp holding key heads [r M/tp, (r+1) M/tp) and the value heads that
read them (value head n reads key head n // (N / M), so they are the same share of N):
- in_proj_z (N * V rows, head-major), in_proj_b and in_proj_a (N rows) split column-wise,
  out_proj row-wise, A_log and dt_bias ([N]) sharded on their head dim: each rank holds its part.
- in_proj_qkv [C, D] and the conv weight [C, 1, W + 1] hold q, k and v side by side, three
  segments of unequal width (2 M K is not N V in the published sizes); a rank's channels are a
  slice of each segment, which no DTensor placement describes (Shard splits the whole dim,
  _StridedShard only equal segments). They stay whole on every tp rank (replicated; FSDP still
  shards them over the data-parallel ranks) and each rank multiplies only its heads' rows:
  compute splits, their memory does not.
- The gated norm's weight [V] is shared by every head: replicated, applied to local heads.
Replicated weights used on a rank's heads only get a partial gradient on each rank (a
`Partial` DTensor gradient, summed over the tp group by `settle_partial_grads`, as the q/k
norms' are).

The layer reads its weights as attributes (`self.conv_weight`, `self.A_log`, ...) in plain
tensor code; `shard_gated_deltanet` gives the module a subclass whose properties return, inside
its forward, the rank's local part of those parameters (outside it, the parameters: FSDP reads
them by name), so the model code stays single-device and the state dict keeps its keys and
whole shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from temper.distributed.tensor_parallel import (
    ColwiseParallel,
    RowwiseParallel,
    apply_tensor_parallel,
    localize_heads,
    per_head_parallel,
)
from temper.models.common.centered_rmsnorm import GatedRMSNorm
from temper.models.common.gated_deltanet import GatedDeltaNet

# [B, T, N, H] activations: the heads are dimension 2.
_HEADS_DIM = 2


def gated_attention_tp_plan() -> dict:
    """Submodule name -> TP style for a full-attention block's mixer."""
    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "attention.q_norm": per_head_parallel(head_dim=_HEADS_DIM),
        "attention.k_norm": per_head_parallel(head_dim=_HEADS_DIM),
    }


def gated_deltanet_tp_plan() -> dict:
    """Submodule name -> TP style for a linear-attention block's split projections (the rest
    of the layer is `shard_gated_deltanet`'s)."""
    return {
        "linear_attention.in_proj_z": ColwiseParallel(),
        "linear_attention.in_proj_b": ColwiseParallel(),
        "linear_attention.in_proj_a": ColwiseParallel(),
        "linear_attention.out_proj": RowwiseParallel(),
    }


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """A rank's part of a tp-sharded parameter; of a replicated one, its whole value, whose
    gradient is this rank's partial sum."""
    if not isinstance(parameter, DTensor):
        return parameter
    if any(isinstance(p, Replicate) for p in parameter.placements):
        partial = tuple(Partial() if isinstance(p, Replicate) else p for p in parameter.placements)
        return parameter.to_local(grad_placements=partial)
    return parameter.to_local()


class _LocalReads:
    """Inside its forward, a module's named parameters read as their local part (`_local`);
    elsewhere (FSDP's bookkeeping, state dicts) as the parameters themselves."""

    local_reads = False

    def _read(self, name: str) -> torch.Tensor:
        parameter = self._parameters[name]
        return _local(parameter) if self.local_reads else parameter

    def forward(self, *args, **kwargs):
        self.local_reads = True
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.local_reads = False


class _HeadSlicedGatedDeltaNet(_LocalReads, GatedDeltaNet):
    """A Gated DeltaNet on one tp rank: its head counts are the local ones and, in its
    forward, its parameters read as the local part (`shard_gated_deltanet`). Never
    constructed: a module's class is set to it."""

    qkv_rows_C: torch.Tensor
    """This rank's rows of in_proj_qkv and the conv weight: its q, k and v channels."""

    @property
    def conv_weight(self) -> torch.Tensor:
        weight = self._read("conv_weight")
        return weight[self.qkv_rows_C] if self.local_reads else weight

    @property
    def A_log(self) -> torch.Tensor:
        return self._read("A_log")

    @property
    def dt_bias(self) -> torch.Tensor:
        return self._read("dt_bias")


class _RowSlicedLinear(nn.Linear):
    """in_proj_qkv on one tp rank: the whole (replicated) weight, this rank's rows of it.
    Never constructed: a module's class is set to it."""

    rows_O: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        # x is whole on every rank, but its gradient here is only this rank's rows' part:
        # a replicated DTensor's partial gradient, summed over the tp group on the way back
        # (what ColwiseParallel's input does for the split projections).
        replicated = (Replicate(),) * weight.device_mesh.ndim
        x_local = DTensor.from_local(x, weight.device_mesh, replicated, run_check=False).to_local(
            grad_placements=(Partial(),) * weight.device_mesh.ndim
        )
        return F.linear(x_local, _local(weight)[self.rows_O])


class _LocalGatedRMSNorm(_LocalReads, GatedRMSNorm):
    """The gated norm on one tp rank's heads, its replicated weight read locally in its
    forward. Never constructed: a module's class is set to it."""

    @property
    def weight(self) -> torch.Tensor:
        return self._read("weight")


def _qkv_rows(layer: GatedDeltaNet, *, rank: int, tp: int) -> torch.Tensor:
    """Channels of key heads [rank M/tp, (rank+1) M/tp) in q and k, and of the value heads
    that read them in v, in in_proj_qkv's order."""
    key_width = layer.num_key_heads * layer.key_head_dim // tp
    value_width = layer.num_value_heads * layer.value_head_dim // tp
    key_dim = layer.num_key_heads * layer.key_head_dim
    device = layer.conv_weight.device
    q = torch.arange(rank * key_width, (rank + 1) * key_width, device=device)
    v = 2 * key_dim + torch.arange(rank * value_width, (rank + 1) * value_width, device=device)
    return torch.cat((q, key_dim + q, v))


def _distribute(module: nn.Module, name: str, *, mesh: DeviceMesh, placement) -> None:
    parameter = module._parameters[name]
    distributed = distribute_tensor(parameter.data, mesh, (placement,))
    module.register_parameter(name, nn.Parameter(distributed, parameter.requires_grad))


def apply_hybrid_tp(block: nn.Module, *, mesh: DeviceMesh, tp: int) -> None:
    """Split a hybrid block's token mixer over the 1-D tp `mesh` by heads (its feed-forward is
    the decoder plan's)."""
    if getattr(block, "linear_attention", None) is not None:
        shard_gated_deltanet(block, mesh=mesh, tp=tp)
    else:
        apply_tensor_parallel(block, mesh=mesh, plan=gated_attention_tp_plan())
        localize_heads(block.attention, attributes=("num_heads", "num_kv_heads"), tp=tp)


def shard_gated_deltanet(block: nn.Module, *, mesh: DeviceMesh, tp: int) -> None:
    """Split a linear-attention block's Gated DeltaNet over the 1-D tp `mesh` by heads."""
    apply_tensor_parallel(block, mesh=mesh, plan=gated_deltanet_tp_plan())
    layer = block.linear_attention
    rows_C = _qkv_rows(layer, rank=mesh.get_local_rank(), tp=tp)
    for name in ("A_log", "dt_bias"):
        _distribute(layer, name, mesh=mesh, placement=Shard(0))
    _distribute(layer, "conv_weight", mesh=mesh, placement=Replicate())
    _distribute(layer.in_proj_qkv, "weight", mesh=mesh, placement=Replicate())
    _distribute(layer.norm, "weight", mesh=mesh, placement=Replicate())
    layer.in_proj_qkv.__class__ = _RowSlicedLinear
    layer.in_proj_qkv.rows_O = rows_C
    layer.norm.__class__ = _LocalGatedRMSNorm
    layer.__class__ = _HeadSlicedGatedDeltaNet
    layer.qkv_rows_C = rows_C
    localize_heads(layer, attributes=("num_key_heads", "num_value_heads"), tp=tp)
    layer.conv_dim = len(rows_C)
