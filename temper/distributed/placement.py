"""Where the trainer and the generator run: on the same ranks, or on ranks of their own.

`colocated` (the default): every rank trains a shard of the model and samples with its own
generator (SPMD). `disaggregated`: the last `generator_ranks` ranks of the world
only generate, the others only train; after each optimizer step the trainer streams its
weights to the generator ranks in buckets (weight_transfer.py), and the trainer ranks send
their sample requests to them.

`Placement(config, world_size=...)` checks the split against the world size before any
collective (the same ValueError on every rank); `split()` then builds, on every rank, the
process groups both roles use (torch makes groups collectively over the whole world):

- the trainer's world (world.py): its group, a gloo group for the loop, its device mesh;
- a weight channel per trainer rank, that rank and every generator rank: a control group
  (gloo, Python objects) and a data group (the device's backend: NCCL on GPU) on which it
  broadcasts its share of the weights in buckets; trainer rank 0's also carries the job's
  commands to the generators;
- one link per (trainer rank, generator rank) pair that exchange sample requests (gloo).
  Trainer rank t sends to the generators `t, t + T, t + 2T, ...` (mod G when there are fewer
  generators than trainers), so every generator serves and every trainer is served.

With `generator_tp` > 1 (vLLM's tensor parallelism), the generator ranks come in groups of
that many: the first of each group is the one the channels and links reach, and runs the
engine over the group's devices; the others only lend it theirs (`Roles.device_lenders`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist

from temper.config.checks import check_choice, check_range
from temper.config.configurable import Configurable
from temper.distributed.deadline import Deadlines
from temper.distributed.parallel_dims import MeshDegrees
from temper.distributed.weight_transfer import WeightChannel
from temper.distributed.world import TrainerWorld

PlacementMode = Literal["colocated", "disaggregated"]


@dataclass(frozen=True)
class Link:
    """A trainer rank and a generator rank that exchange requests, and their gloo group."""

    trainer: int
    generator: int
    group: Any


@dataclass(frozen=True)
class Roles:
    """What one rank does under a disaggregated placement, and the groups it talks on."""

    rank: int
    trainer_world: TrainerWorld
    generator_ranks: tuple[int, ...]
    weight_channels: tuple[WeightChannel, ...]
    """One per trainer rank, in order: that rank and every generator rank (its weight
    buckets; trainer rank 0's also carries the job's commands)."""
    links: tuple[Link, ...]
    """This rank's request links (a trainer's to its generators, a generator's to its
    trainers)."""
    device_lenders: tuple[int, ...] = ()
    """Generator ranks that run no engine: each lends its device to the tensor-parallel
    engine of the generator rank before it (generator_tp > 1)."""

    @property
    def is_generator(self) -> bool:
        """A rank of the generator side (one that runs an engine, or lends it a device)."""
        return self.rank in self.generator_ranks or self.rank in self.device_lenders

    @property
    def lends_device(self) -> bool:
        return self.rank in self.device_lenders

    @property
    def trainer_ranks(self) -> tuple[int, ...]:
        return self.trainer_world.ranks

    @property
    def sync_control(self) -> Any:
        """gloo group of trainer rank 0 and the generator ranks (commands)."""
        return self.weight_channels[0].control


class Placement(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        mode: PlacementMode = "colocated"
        """'colocated': every rank trains and generates; 'disaggregated': the last
        `generator_ranks` ranks generate and the others train."""
        generator_ranks: int = 1
        """Disaggregated: how many ranks generate (the last ones of the world)."""
        generator_tp: int = 1
        """Disaggregated: ranks (devices) each generator engine spans with tensor parallelism
        (vLLM only: Temper's engine has none). The first rank of each group of
        `generator_tp` runs the engine over the group's devices; the others lend it theirs."""
        bucket_mb: float = 256.0
        """Weight sync: the most MiB of weights sent at once (a larger tensor is split by rows)."""
        transfer_dtype: Literal["float32", "bfloat16"] | None = None
        """Weight sync: the dtype weights travel in; None: the trainer's."""
        overlap_sync: bool = False
        """Weight sync: each generator rank receives a new version into a second copy of the
        weights while it still samples the current one, and copies it in once the current
        version's requests have run, so the transfer overlaps sampling (async mode). Costs
        one more copy of the weights per generator rank (`temper plan` counts it)."""
        sync_timeout_s: float = 600.0
        """Deadline of one weight sync (every bucket of a version, from every trainer rank to
        every generator rank) and of each command the trainer sends the generator ranks; a
        peer that dies ends the sync at once, one that stalls when this passes, with an error
        naming the rank, the bucket and the bytes so far. 600 s covers a 70B model in bf16
        (140 GB) at 0.25 GB/s, a tenth of a 25 Gb/s Ethernet link and far below NCCL over
        NVLink or InfiniBand (tens of GB/s), with the layer-by-layer gathers of FSDP shards
        and the generator's load included."""
        call_timeout_s: float = 1800.0
        """Deadline of one call to a generator rank (a batch to sample or score), from the
        request to the whole answer. 1800 s covers a batch of 32k-token completions of a 70B
        model decoding at about 20 tokens/s per sequence (a large batch on one engine)."""

        def __post_init__(self) -> None:
            modes = ("colocated", "disaggregated")
            check_choice(self.mode, field="Placement.Config.mode", choices=modes)
            for name in ("generator_ranks", "generator_tp"):
                value = getattr(self, name)
                check_range(value, field=f"Placement.Config.{name}", integer=True, at_least=1)
            if not isinstance(self.overlap_sync, bool):
                raise ValueError(
                    "Placement.Config.overlap_sync must be true or false, got "
                    f"{self.overlap_sync!r}"
                )
            if self.mode == "colocated":
                # Each would be silently ignored: colocated, every rank generates.
                for name, default in (
                    ("generator_ranks", 1),
                    ("generator_tp", 1),
                    ("overlap_sync", False),
                ):
                    if getattr(self, name) != default:
                        raise ValueError(
                            f"Placement.Config.{name}={getattr(self, name)} is for mode "
                            "'disaggregated' (colocated ranks each run a whole generator): "
                            "add --placement.mode disaggregated"
                        )
            if self.generator_ranks % self.generator_tp:
                raise ValueError(
                    f"Placement.Config.generator_tp={self.generator_tp} must divide "
                    f"generator_ranks={self.generator_ranks} (each engine spans generator_tp "
                    "ranks)"
                )
            for name in ("bucket_mb", "sync_timeout_s", "call_timeout_s"):
                check_range(getattr(self, name), field=f"Placement.Config.{name}", greater_than=0)

        @property
        def bucket_bytes(self) -> int:
            return max(1, int(self.bucket_mb * 2**20))

        @property
        def deadlines(self) -> Deadlines:
            return Deadlines(sync_s=self.sync_timeout_s, call_s=self.call_timeout_s)

        @property
        def trainer_timeout_s(self) -> float:
            """The timeout of the trainer ranks' own groups: a rank may wait at one of their
            collectives while another finishes a call or a sync."""
            return max(self.sync_timeout_s, self.call_timeout_s)

    def __init__(self, config: Config, *, world_size: int) -> None:
        self.config = config
        self.world_size = world_size
        if self.disaggregated and config.generator_ranks >= world_size:
            raise ValueError(
                f"Placement.Config.generator_ranks={config.generator_ranks} leaves no trainer "
                f"rank in a world of {world_size}: a disaggregated placement needs at least "
                f"{config.generator_ranks + 1} ranks (start more, e.g. --nproc "
                f"{config.generator_ranks + 1}, or use fewer generator ranks)"
            )

    @property
    def disaggregated(self) -> bool:
        return self.config.mode == "disaggregated"

    @property
    def num_trainers(self) -> int:
        return (
            self.world_size - self.config.generator_ranks if self.disaggregated else self.world_size
        )

    def split(self, *, trainer_mesh: MeshDegrees | None, device_type: str) -> Roles:
        """Build every group of a disaggregated placement (collective over the whole world)
        and return this rank's roles; `trainer_mesh`: the trainer's sharding degrees (None:
        an unsharded trainer on one rank)."""
        assert self.disaggregated, "split() is for a disaggregated placement"
        timeout = timedelta(seconds=self.config.sync_timeout_s)
        trainer_timeout = timedelta(seconds=self.config.trainer_timeout_s)
        call_timeout = timedelta(seconds=self.config.call_timeout_s)
        trainers = tuple(range(self.num_trainers))
        tp = self.config.generator_tp
        everyone = range(self.num_trainers, self.world_size)
        generators = tuple(everyone[::tp])  # each runs an engine over its group's devices
        lenders = tuple(rank for rank in everyone if rank not in generators)
        world = TrainerWorld(
            ranks=trainers,
            group=dist.new_group(list(trainers), timeout=trainer_timeout),
            loop_group=dist.new_group(list(trainers), backend="gloo", timeout=trainer_timeout),
        )
        if trainer_mesh is not None:
            world.prepare_mesh(trainer_mesh, device_type=device_type)
        channels = []
        for trainer in trainers:
            ranks = [trainer, *generators]
            control = dist.new_group(ranks, backend="gloo", timeout=timeout)
            data = dist.new_group(ranks, timeout=timeout)
            channels.append(
                WeightChannel(control=control, data=data, sender=trainer, receivers=generators)
            )
        rank = dist.get_rank()
        links = []
        for trainer, generator in request_pairs(len(trainers), generators):
            group = dist.new_group([trainer, generator], backend="gloo", timeout=call_timeout)
            if rank in (trainer, generator):
                links.append(Link(trainer=trainer, generator=generator, group=group))
        return Roles(
            rank=rank,
            trainer_world=world,
            generator_ranks=generators,
            weight_channels=tuple(channels),
            links=tuple(links),
            device_lenders=lenders,
        )


def request_pairs(num_trainers: int, generators: tuple[int, ...]) -> list[tuple[int, int]]:
    """(trainer, generator) pairs that exchange requests: every trainer rank is linked to at
    least one generator and every generator to at least one trainer."""
    count = max(num_trainers, len(generators))
    pairs = {(index % num_trainers, generators[index % len(generators)]) for index in range(count)}
    return sorted(pairs)
