"""Tensor-parallel building blocks (DTensor) that any decoder plan is made of.

Shapes: B batch, T tokens, N heads, H head dim.

The Megatron pattern: a column-wise linear splits its output features across the tp ranks, a
row-wise linear takes those split features and sums the partial outputs, so activations are
whole (replicated) between sublayers and split only inside attention (by heads) and the
feed-forward (by hidden width). Replicated activations mean the parameters outside those
regions (embedding, RMSNorms between sublayers, unembedding) need no TP at all: every tp rank
computes the same gradient for them.

Two things are model-agnostic but not in torch's plan styles:
- Per-head layers inside a head-split region (Qwen3's q/k RMSNorm) see only this rank's heads,
  so their gradient is a partial sum over the tp group. `per_head_parallel` makes such a
  layer's parameters replicated DTensors and its input a head-sharded DTensor, so DTensor
  tracks the partial gradient; `settle_partial_grads` (temper/distributed/grad_norm.py) sums it.
- Modules that reshape by head count must use the local count: `localize_heads`.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = [
    "ColwiseParallel",
    "RowwiseParallel",
    "apply_tensor_parallel",
    "localize_heads",
    "per_head_parallel",
]


def per_head_parallel(*, head_dim: int) -> ParallelStyle:
    """A style for a layer applied to each head of a head-split [B, T, N/tp, H] activation.

    Its parameters become replicated DTensors; its input is read as sharded along `head_dim`
    (the heads dimension); the output goes back to a plain local tensor.
    """
    # SequenceParallel is exactly "replicated parameters, input sharded along one dimension,
    # computed locally"; here the sharded dimension is the heads, not the sequence.
    return SequenceParallel(sequence_dim=head_dim, use_local_output=True)


def apply_tensor_parallel(
    module: nn.Module, *, mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]
) -> None:
    """Apply `plan` (submodule name -> style) to `module` over the 1-D tp `mesh`, in place."""
    assert mesh.ndim == 1, "tensor parallelism takes the 1-D tp sub-mesh"
    parallelize_module(module, mesh, dict(plan))


def localize_heads(module: nn.Module, *, attributes: tuple[str, ...], tp: int) -> None:
    """Divide head-count attributes (e.g. num_heads) by `tp`: after a column-wise split each
    rank holds that many heads and reshapes its activations by the local count."""
    for name in attributes:
        count = getattr(module, name)
        assert count % tp == 0, f"{name}={count} is not divisible by tp={tp}"
        setattr(module, name, count // tp)
