"""Whole tensors from a sharded model, for each rank's sampler copy and for export.

`DTensor.full_tensor()` all-gathers the shards (FSDP over dp, TP over tp) into the exact
values a single-process model would hold: nothing is recomputed, so the result is bitwise the
unsharded tensor. Collective: every rank calls these and every rank gets whole tensors.

`sampler_stream` is what a sampler loads after each optimizer step, one tensor at a time (a
whole dict would be a second copy of the model): the full weights, or, for LoRA, the base
weights with every adapter merged (W + scale * B @ A, formed in fp32 and cast back, the same
arithmetic as `temper.models.lora.merged_state_dict`). `sampler_state_dict` is the same as a
dict of new tensors. `sampler_share` is one rank's part of the same weights for generators on
other ranks: its own rows of every FSDP-sharded tensor as they are, and the rest whole from
one rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from temper.distributed.local_shard import local_box, local_part
from temper.distributed.weight_pieces import (
    Destination,
    PlacedStream,
    WeightPiece,
    WeightRows,
    as_bytes,
)
from temper.models.lora import (
    LORA_SUFFIXES,
    LoraModule,
    LoraUnembedding,
    adapted_key,
    lora_modules,
)


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (FSDP- or TP-sharded)."""
    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


@torch.no_grad()
def full_state_dict(
    model: nn.Module, *, keep: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every DTensor gathered whole (only keys `keep` accepts).

    Always new tensors, never views of the model's (later steps do not change them).
    """
    return {
        key: _gathered(value, copy=True)
        for key, value in model.state_dict().items()
        if keep is None or keep(key)
    }


@torch.no_grad()
def sampler_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's weights for a sampler: whole, with LoRA adapters merged (new tensors).

    Keys are those of a model built from `temper.models.lora.merged_config(model)`.
    """
    return {key: value.clone() for key, value in sampler_stream(model)}


def sampler_stream(model: nn.Module, *, bucket_bytes: int | None = None) -> PlacedStream:
    """`sampler_state_dict` one tensor at a time, for a sampler to copy as it arrives: never
    more than one whole tensor (and its merge) beside the model. Collective on a sharded
    model: every rank must consume the whole stream, in order.

    With `bucket_bytes`, a tensor FSDP shards by rows is not gathered: each rank in turn
    broadcasts its rows, at most `bucket_bytes` at a time, and they come as `WeightRows`
    (straight in the loader's model where it set the stream's `into`).

    A piece is valid until the next one is drawn (it may be the model's own, unsharded)."""
    return PlacedStream(lambda into: _stream(model, bucket_bytes=bucket_bytes, into=into))


@torch.no_grad()
def _stream(
    model: nn.Module, *, bucket_bytes: int | None, into: Destination | None
) -> Iterator[WeightPiece]:
    plan = _SamplerPlan(model)
    for key in plan.plain:
        value = plan.state[key]
        if bucket_bytes is not None and _rows_over_one_mesh_dim(value):
            yield from _broadcast_rows(key, value, bucket_bytes=bucket_bytes, into=into)
        else:
            yield key, _gathered(value)
    yield from plan.merged()


@torch.no_grad()
def sampler_share(model: nn.Module, *, lead: bool) -> Iterator[WeightPiece]:
    """This rank's share of the sampler weights, for generators on other ranks that collect
    every trainer rank's share (collective: every rank consumes its whole stream).

    A tensor sharded only by rows (FSDP's dim-0 chunks) comes as each rank's own rows, as
    they are: nothing is gathered. Every other tensor (replicated, split by columns, merged
    with LoRA adapters) comes whole from the `lead` rank alone, gathered with the others
    first: so once a rank sends its rows, it takes part in no more collectives."""
    plan = _SamplerPlan(model)
    rows = [key for key in plan.plain if _split_by_rows_only(plan.state[key])]
    for key in plan.plain:
        if key not in rows:
            whole = _gathered(plan.state[key])
            if lead:
                yield key, whole
    for key, merged in plan.merged():
        if lead:
            yield key, merged
    for key in rows:
        value = plan.state[key]
        if _sends_its_rows(value) and (local := local_part(value)).shape[0]:
            box = local_box(value)[0]
            assert local.shape[0] == box.stop - box.start, (key, tuple(local.shape), box)
            yield WeightRows(name=key, start=box.start, value=local)


class _SamplerPlan:
    """Which of a model's tensors a sampler takes as they are (`plain`), and which merged
    with their LoRA adapters."""

    def __init__(self, model: nn.Module) -> None:
        self._merges: dict[str, tuple[str, str, LoraModule]] = {}
        for name, module in lora_modules(model).items():
            key = adapted_key(name, module)
            if isinstance(module, LoraUnembedding) and model.output is None:
                self._merges[key] = (name, "embed.weight", module)
            else:
                self._merges[key] = (name, key, module)
        self.state = model.state_dict()
        self.plain = [
            key for key in self.state if not key.endswith(LORA_SUFFIXES) and key not in self._merges
        ]

    def merged(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each adapted weight merged (gathered whole: collective)."""
        for key, (name, base_key, module) in self._merges.items():
            weight = _gathered(self.state[base_key])
            lora_A = _gathered(self.state[f"{name}.lora_A"]).float()
            lora_B = _gathered(self.state[f"{name}.lora_B"]).float()
            yield key, (weight.float() + module.scale * (lora_B @ lora_A)).to(weight.dtype)


def _split_by_rows_only(value: torch.Tensor) -> bool:
    """A DTensor cut along dimension 0 only (the same answer on every rank)."""
    if not isinstance(value, DTensor):
        return False
    mesh, placements = value.device_mesh, value.placements
    cuts = [
        placement
        for dim, placement in enumerate(placements)
        if not placement.is_replicate() and mesh.size(dim) > 1
    ]
    return bool(cuts) and all(isinstance(cut, Shard) and cut.dim == 0 for cut in cuts)


def _rows_over_one_mesh_dim(value: torch.Tensor) -> bool:
    """A DTensor split by rows over a 1-D mesh (FSDP's own parameters)."""
    return _split_by_rows_only(value) and value.device_mesh.ndim == 1


def _broadcast_rows(
    key: str, value: DTensor, *, bucket_bytes: int, into: Destination | None
) -> Iterator[WeightRows]:
    """Every rank's rows of `value` (`Shard(0)` over a 1-D mesh) on every rank: each rank in
    turn broadcasts its rows, at most `bucket_bytes` (and at least one row) at a time, and the
    others receive them where `into` says (else into a buffer of that size). A rank's own rows
    come as they are."""
    mesh = value.device_mesh
    ranks, rows_total = mesh.size(), value.shape[0]
    chunk = -(-rows_total // ranks)  # a rank's rows (torch.chunk: the last ones may have fewer)
    local, me = local_part(value), mesh.get_local_rank()
    assert local.is_contiguous() and local.shape[0] == max(0, min(chunk, rows_total - me * chunk))
    row_shape = tuple(value.shape[1:])
    step = max(1, bucket_bytes // max(1, math.prod(row_shape) * value.dtype.itemsize))
    buffer: torch.Tensor | None = None
    for rank, global_rank in enumerate(mesh.mesh.flatten().tolist()):
        first_row = min(rank * chunk, rows_total)
        count = min(rows_total, first_row + chunk) - first_row
        for first in range(0, count, step):
            rows, start = min(step, count - first), first_row + first
            if rank == me:
                part = local[first : first + rows]
            else:
                part = into(key, start, (rows, *row_shape), value.dtype) if into else None
                if part is None:
                    if buffer is None:
                        buffer = local.new_empty((min(step, chunk), *row_shape))
                    part = buffer[:rows]
            dist.broadcast(as_bytes(part), src=global_rank, group=mesh.get_group(0))
            yield WeightRows(name=key, start=start, value=part)


def _sends_its_rows(value: DTensor) -> bool:
    """Of the ranks that hold the same rows (replicas along a mesh dimension), the first."""
    coordinate = value.device_mesh.get_coordinate()
    assert coordinate is not None
    return all(
        index == 0 or not placement.is_replicate()
        for index, placement in zip(coordinate, value.placements, strict=True)
    )


def _gathered(value: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """The whole tensor: an all-gather of a DTensor's shards (a new tensor), else the
    (replicated) local one itself, or a copy of it with `copy`."""
    if isinstance(value, DTensor):
        if not all(placement.is_replicate() for placement in value.placements):
            return value.full_tensor()
        value = value.to_local()  # nothing to gather (full_tensor() would return it as is)
    return value.detach().clone() if copy else value.detach()
