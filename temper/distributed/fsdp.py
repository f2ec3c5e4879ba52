"""FSDP2 (`fully_shard`) for any model made of a root and a list of blocks.

Each block is its own FSDP unit (all-gathered just before it runs, freed after), the root
holds what is left (embedding, final norm, unembedding, adapters on them). Modules that are
sharded over a mesh of their own (expert-parallel experts, over the ranks that hold the same
experts) are units of their own inside their block, sharded first.

Two things differ from FSDP's defaults:
- Gradients are summed over data-parallel ranks, not averaged. Temper's losses are sums over
  every datum of a step (Tinker semantics), and each rank holds a share of the datums, so the
  sum over ranks is the single-process gradient of the union of the data.
- Methods other than `forward` that run the model (`hidden_states`) are registered with FSDP
  so they all-gather and reshard like `forward`. The root is not resharded after forward: the
  unembedding it holds is read after `hidden_states` returns (chunked logprobs). Callers that
  run a forward without backward must `reshard()` the root afterwards (see `reshard_root`), or
  an optimizer step would leave its gathered copy stale.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)


def apply_fsdp(
    model: nn.Module,
    *,
    blocks: Iterable[nn.Module],
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    forward_methods: Sequence[str] = (),
    inner: Iterable[tuple[nn.Module, DeviceMesh]] = (),
) -> FSDPModule:
    """Shard each of `inner` over its own mesh, then each of `blocks` and then the root
    `model` over `mesh` (1-D FSDP, 2-D HSDP).

    `param_dtype`/`reduce_dtype` set a mixed-precision policy (None keeps the parameters'
    dtype). Returns the model, now an `FSDPModule`.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for module, module_mesh in inner:
        fully_shard(
            module,
            mesh=module_mesh,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward,
        )
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for name in forward_methods:
        register_fsdp_forward_method(model, name)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum over ranks (see the module docstring). Plain SUM collectives: gloo has no
            # PREMUL_SUM, and a factor of 1 needs no scaling anyway.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def reshard_root(model: nn.Module) -> None:
    """Free the root's gathered parameters after a forward that had no backward."""
    if isinstance(model, FSDPModule):
        model.reshard()
