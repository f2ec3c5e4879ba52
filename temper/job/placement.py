"""A job's ranks under its placement (distributed/placement.py): each rank's sampler settings,
and, when disaggregated, the roles split, the generator ranks' service and the trainer ranks'
way to them."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from temper.client.sampler_weights import load_sampler_directory
from temper.distributed.placement import Placement, Roles
from temper.generator.choice import GeneratorChoice
from temper.generator.generator_rank import GeneratorRank, keeps_second_copy
from temper.generator.remote import RemoteGenerators
from temper.job.memory_plan import PlanSettings, Role, plan_memory
from temper.job.memory_report import describe_for_rank
from temper.job.model import ModelChoice
from temper.models.build import dtype_name, parse_dtype
from temper.models.common.decoder import DecoderConfig
from temper.observability.process_memory import device_memory_bytes
from temper.sampler.engine import SamplerEngine
from temper.trainer.engine import TrainerEngine
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


def serve_generator(
    roles: Roles,
    *,
    placement: Placement.Config,
    sampler: SamplerEngine.Config,
    generator: GeneratorChoice.Config,
    device: str,
    on_start: Callable[[DecoderConfig], None] | None = None,
) -> None:
    """Run this generator rank until the trainer ranks are done (`on_start(model config)`
    once it knows the model). vLLM runs in its own engine process: in this one it would
    join the job's process group as if it were its own. With `generator_tp` > 1 it spans
    this rank's device and the next ranks' (which lend them: they return at once)."""
    tp = placement.generator_tp
    if roles.lends_device:
        print(
            f"generator rank {roles.rank}: lends its device to the tensor-parallel engine of "
            f"rank {max(r for r in roles.generator_ranks if r < roles.rank)} (tp {tp})",
            file=sys.stderr,
            flush=True,
        )
        return
    if generator.backend == "vllm":
        vllm = dataclasses.replace(
            generator.vllm, engine_process="separate", tensor_parallel_size=tp
        )
        generator = dataclasses.replace(generator, vllm=vllm)
        if torch.device(device).type == "cuda":
            # Also at tp 1: vLLM's engine process would otherwise see every GPU and take
            # cuda:0, a trainer's.
            lend_group_devices(tp)
    GeneratorRank(
        roles=roles,
        engine=rank_sampler(sampler),
        backend=generator,
        device=rank_device(device),
        overlap_sync=placement.overlap_sync,
        deadlines=placement.deadlines,
        on_start=on_start,
        load_reference=functools.partial(_load_reference, device=rank_device(device)),
    ).serve()


def lend_group_devices(tp: int) -> None:
    """vLLM's processes (started by this rank) see this rank's GPU and the next `tp - 1`
    local ranks' (torchrun gives local rank i GPU i; the group must sit on one node)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", str(torch.cuda.device_count())))
    if local_rank + tp > local_ranks:
        raise ValueError(
            f"Placement.Config.generator_tp={tp}: the engine of local rank {local_rank} would "
            f"span local ranks {local_rank}..{local_rank + tp - 1}, past this node's "
            f"{local_ranks}; a tensor-parallel group must sit on one node (make "
            "generator_ranks per node a multiple of generator_tp)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(local_ranks)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices[local_rank : local_rank + tp])


def _load_reference(directory: str, dtype: torch.dtype, *, device: torch.device) -> nn.Module:
    """A KL reference's model, from a sampler checkpoint directory (a generator rank's)."""
    weights = load_sampler_directory(
        Path(directory), name=directory, device=str(device), dtype=dtype_name(dtype)
    )
    return weights.model


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
        overlap_sync=placement.overlap_sync,
        deadlines=placement.deadlines,
    )


def plan_settings(
    placement: Placement,
    *,
    nnodes: int = 1,
    model: ModelChoice.Config,
    sampler: SamplerEngine.Config,
    trainer: TrainerEngine.Config,
    sharding: Sharding.Config,
    generator: GeneratorChoice.Config,
    batch: int,
    mode: Literal["sync", "async"],
    kl_reference: bool,
    gpu_memory_gib: float,
    headroom: float = PlanSettings.headroom,
) -> PlanSettings:
    """What a job's memory plan (job/memory_plan.py) is computed from, read off its configs:
    the one mapping `temper plan` and a job's startup log share. `placement` holds the world
    size, spread over `nnodes` machines."""
    config = placement.config
    disaggregated = placement.disaggregated
    return PlanSettings(
        model=model.base_model,
        lora_rank=model.lora_rank,
        dtype=model.precision.name,  # 'auto' as on the job's device
        transfer_dtype=config.transfer_dtype,
        nnodes=nnodes,
        nproc_per_node=placement.world_size // nnodes,
        placement=config.mode,
        generator_ranks=config.generator_ranks if disaggregated else 0,
        generator_tp=config.generator_tp,
        dp_replicate=sharding.dims.dp_replicate,
        ep=sharding.dims.ep,
        batch=batch,
        max_seq_len=sampler.max_seq_len,
        max_batch=sampler.max_batch,
        # vLLM's prefix cache lives in its own KV cache.
        prefix_cache_mib=sampler.prefix_cache_mib if generator.backend == "temper" else 0.0,
        micro_batch_tokens=trainer.max_tokens_per_microbatch,
        activation_checkpointing=sharding.activation_checkpointing,
        bucket_mb=max(1, round(config.bucket_mb)),
        overlap_sync=disaggregated
        and keeps_second_copy(overlap_sync=config.overlap_sync, backend=generator),
        mode=mode,
        kl_reference=kl_reference,
        device="cuda" if model.device.startswith("cuda") else "cpu",
        gpu_memory_gib=gpu_memory_gib,
        headroom=headroom,
    )


def memory_plan_line(settings: PlanSettings, *, role: Role, decoder: DecoderConfig) -> str:
    """This rank's planned bytes (job/memory_plan.py) for the model it built, one line for its
    startup log."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return describe_for_rank(plan_memory(settings, decoder=decoder), rank=rank, role=role)


def rank_memory_gib(device: str, *, ranks: int) -> float:
    """Memory one rank may use in GiB: its GPU's, or on CPU this machine's shared by its
    ranks."""
    return _rank_memory_bytes(device, ranks=ranks) / 2**30


def _rank_memory_bytes(device: str, *, ranks: int) -> int:
    """Memory one rank may use: its GPU's, or on CPU this machine's shared by its ranks."""
    if torch.device(device).type == "cuda":
        return device_memory_bytes(device)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    return device_memory_bytes(device) // max(1, local_ranks)
