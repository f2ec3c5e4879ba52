"""A job's ranks under its placement (distributed/placement.py): each rank's sampler settings,
and, when disaggregated, the roles split, the generator ranks' service and the trainer ranks'
way to them."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from temper.distributed.placement import Placement, Roles
from temper.models.build import parse_dtype
from temper.sampler.engine import SamplerEngine
from temper.sampler.generator_rank import GeneratorRank
from temper.sampler.remote import RemoteGenerators
from temper.trainer.sharding import Sharding


def rank_sampler(sampler: SamplerEngine.Config) -> SamplerEngine.Config:
    """The engine's settings on one rank of several: no helper processes (the ranks already
    use the cores)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return sampler
    return dataclasses.replace(sampler, cpu=dataclasses.replace(sampler.cpu, processes=1))


def rank_device(device: str) -> torch.device:
    """This rank's device for a job on `device` ('cuda': the GPU torchrun gave this rank)."""
    if torch.device(device).type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def split_roles(placement: Placement, *, sharding: Sharding.Config, device: str) -> Roles:
    """Split the world into trainer and generator ranks (collective: every rank calls it),
    with the trainer's mesh for `sharding` on its ranks (none for one trainer rank)."""
    trainers = placement.num_trainers
    degrees = None if trainers == 1 else sharding.dims.build(world_size=trainers).degrees
    return placement.split(trainer_mesh=degrees, device_type=torch.device(device).type)


def serve_generator(roles: Roles, *, sampler: SamplerEngine.Config, device: str) -> None:
    """Run this generator rank until the trainer ranks are done."""
    GeneratorRank(roles=roles, engine=rank_sampler(sampler), device=rank_device(device)).serve()


def remote_generators(
    roles: Roles, *, placement: Placement.Config, device: str
) -> RemoteGenerators:
    """A trainer rank's way to the generator ranks, with the placement's transfer settings."""
    transfer = placement.transfer_dtype
    return RemoteGenerators(
        roles=roles,
        bucket_bytes=placement.bucket_bytes,
        transfer_dtype=None if transfer is None else parse_dtype(transfer),
        device=rank_device(device),
    )
