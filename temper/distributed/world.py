"""The trainer's world: the ranks a trainer and its loop run on, and their process groups.

Colocated (the default) that is the whole torchrun world. With a disaggregated placement
(placement.py) it is the trainer ranks only, while the other ranks generate. Everything that
talks among the trainer's ranks asks `trainer_world()` instead of the default process group:
the sharding mesh, the trainer's agreement collectives, distributed checkpoints, the loop's
`Ranks`.

torch creates process groups and device meshes collectively over the whole world: every rank,
generator ranks included, must make the same `new_group` calls in the same order. So a
placement builds the trainer's groups and mesh on every rank before the roles part
(`TrainerWorld.prepare_mesh`); a trainer on the whole world (colocated) builds its mesh when
it asks for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from temper.distributed.parallel_dims import EXPERT_MESH_DIMS, MESH_DIMS, MeshDegrees


@dataclass(frozen=True)
class TrainerMeshes:
    """The device meshes a sharded trainer runs on."""

    mesh: DeviceMesh
    """`(dp_replicate, dp_shard, tp)` over the trainer's ranks."""
    dp: DeviceMesh
    """Its data-parallel ranks flattened (dp_replicate x dp_shard)."""
    experts: DeviceMesh | None
    """`(dp_replicate, efsdp, ep, tp)`: dp_shard split for routed experts (expert
    parallelism, parallel_dims.py); None when ep is 1."""


@dataclass
class TrainerWorld:
    ranks: tuple[int, ...]
    """Global ranks of the trainer, in order (its rank i is global rank ranks[i])."""
    group: Any = None
    """The trainer ranks' process group; None: the default group (the whole world)."""
    loop_group: Any = None
    """A gloo group over the trainer ranks for the loop's collectives (placement only)."""
    _meshes: dict[tuple[MeshDegrees, str], TrainerMeshes] = field(default_factory=dict)

    @property
    def is_whole(self) -> bool:
        """The trainer runs on every rank of the world."""
        return self.group is None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's rank among the trainer's ranks."""
        return self.ranks.index(dist.get_rank()) if dist.is_initialized() else 0

    def mesh(self, degrees: MeshDegrees, *, device_type: str) -> TrainerMeshes:
        """The meshes of `degrees` over the trainer's ranks. The whole world builds new ones
        (collective: every rank calls it); a placement's trainer ranks get the ones
        `prepare_mesh` built on every rank."""
        if self.is_whole:
            return _build_meshes(self.ranks, degrees, device_type=device_type)
        key = (degrees, device_type)
        if key not in self._meshes:
            prepared = [f"{d} on {device}" for d, device in self._meshes] or ["none"]
            raise ValueError(
                f"the trainer's mesh {degrees} on {device_type} was not prepared by the "
                f"placement, which prepared {', '.join(prepared)}; give the job's sharding "
                "degrees to the placement"
            )
        return self._meshes[key]

    def prepare_mesh(self, degrees: MeshDegrees, *, device_type: str) -> None:
        """Build the trainer's meshes for `degrees` ahead of time. Collective over the whole
        world (generator ranks too)."""
        self._meshes[(degrees, device_type)] = _build_meshes(
            self.ranks, degrees, device_type=device_type
        )


def _build_meshes(
    ranks: tuple[int, ...], degrees: MeshDegrees, *, device_type: str
) -> TrainerMeshes:
    layout = torch.tensor(ranks, dtype=torch.int64).reshape(degrees.shape)
    mesh = DeviceMesh(device_type, layout, mesh_dim_names=MESH_DIMS)
    experts = None
    if degrees.ep > 1:
        # From the same root, so FSDP can combine the expert mesh's dimensions with the
        # others; ep innermost: an ep group is neighbouring dp_shard ranks.
        efsdp, ep = degrees.expert_shape[1:3]
        experts = mesh._unflatten("dp_shard", (efsdp, ep), EXPERT_MESH_DIMS[1:3])
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return TrainerMeshes(mesh=mesh, dp=dp, experts=experts)


_current: TrainerWorld | None = None


def trainer_world() -> TrainerWorld:
    """The trainer's world: the one a placement set, else every rank (or one process)."""
    if _current is not None:
        return _current
    size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return TrainerWorld(ranks=tuple(range(size)))


@contextlib.contextmanager
def using_trainer_world(world: TrainerWorld) -> Iterator[TrainerWorld]:
    """Make `world` the trainer's world while inside (a placement's trainer ranks)."""
    global _current
    previous, _current = _current, world
    try:
        yield world
    finally:
        _current = previous
