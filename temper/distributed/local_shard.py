"""Which part of a whole tensor this rank holds, for a parameter sharded by FSDP2 and/or TP.

A DTensor's placements say how the whole tensor is cut over its mesh; this rank's part is one
box of it (a range per dimension), so it can be read from a file, or copied out of a whole
tensor, without any collective. Placements handled: Shard (FSDP's dim-0 chunks, TP's column
and row splits, uneven chunks included), Replicate (whole along that mesh dimension), and FSDP
over TP on one dimension (`_StridedShard` then `Shard`), whose nested chunks are again one
contiguous range. A plain tensor is held whole.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# FSDP2 marks a dimension that TP split first as `_StridedShard`; torch exports no public
# name for it.
from torch.distributed.tensor.placement_types import _StridedShard


def local_box(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The slices of the whole tensor that this rank's `local_part(tensor)` holds."""
    if not isinstance(tensor, DTensor):
        return tuple(slice(0, size) for size in tensor.shape)
    _check_placements(tensor)
    local_shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple(
        slice(start, start + size) for start, size in zip(offset, local_shape, strict=True)
    )


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The storage this rank holds: a DTensor's local shard, or a plain tensor itself.
    Writing into it (under no_grad) writes the parameter."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():  # the local tensor itself, not an autograd view of it
            return tensor.to_local()
    return tensor


@torch.no_grad()
def copy_local_part(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy this rank's box of `whole` (shaped like the whole `target`) into `target`."""
    assert tuple(whole.shape) == tuple(target.shape), (tuple(whole.shape), tuple(target.shape))
    local_part(target).copy_(whole[local_box(target)])


def _check_placements(tensor: DTensor) -> None:
    """Every rank's part is a box: a strided shard must be refined by a plain shard of the
    same dimension on a later mesh dimension (FSDP over TP)."""
    placements = tensor.placements
    for index, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            later = placements[index + 1 :]
            assert any(type(p) is Shard and p.dim == placement.dim for p in later), (
                f"a strided shard without a later shard of dim {placement.dim}: {placements}"
            )
        else:
            assert isinstance(placement, Shard | Replicate), (
                f"cannot place a local part of {placements} (partial sums hold no values)"
            )
