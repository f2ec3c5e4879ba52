"""A model sharded over the ranks of a torch.distributed job, and the collectives its trainer
needs around the model's own (FSDP/TP) ones.

`Sharding.Config` is what a trainer config carries (`TrainerEngine.Config.sharding`); building
it checks the degrees against the world size and the model, builds the device mesh and
applies the model family's `parallelize` plan. Every rank runs the same program (SPMD):

- Each rank trains on its own share of the data; ranks of one tp group get the same share.
- Collectives inside FSDP/TP must be entered the same number of times on every rank, so a
  rank with fewer micro-batches runs empty ones (`max_over_ranks`).
- A request one rank rejects is rejected on all of them (`agree_or_raise`), before any
  collective runs, so a bad request never leaves a rank waiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from temper.config.checks import check_choice
from temper.config.configurable import Configurable
from temper.distributed.parallel_dims import ParallelDims
from temper.distributed.world import trainer_world
from temper.models.build import dtype_name
from temper.models.registry import family_of_model


class Sharding(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        dims: ParallelDims.Config = field(default_factory=ParallelDims.Config)
        """Parallel degrees (dp_replicate x dp_shard x tp = world size; ep divides dp_shard)."""
        activation_checkpointing: Literal["none", "full"] = "none"
        """'full' recomputes each block's activations in backward to save memory."""
        compile: bool = False
        """torch.compile each block (opt-in: slow to warm up on CPU)."""
        param_dtype: Literal["float32", "bfloat16"] | None = None
        """FSDP mixed precision: the dtype shards are gathered and computed in; None: the
        trainer's compute dtype (bf16 under the 'bf16-mixed' precision), else the
        parameters' dtype."""
        reduce_dtype: Literal["float32", "bfloat16"] | None = None
        """FSDP mixed precision gradient-reduction dtype; None: the parameters' dtype under
        a mixed precision (fp32 sums of bf16 gradients), else `param_dtype`."""

        def __post_init__(self) -> None:
            check_choice(
                self.activation_checkpointing,
                field="Sharding.Config.activation_checkpointing",
                choices=("none", "full"),
            )

    def __init__(
        self,
        config: Config,
        *,
        model: nn.Module,
        device: torch.device | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """`device`: where the model's shards live; default: the model's device. A model on
        the meta device (sharded loading) is given storage there after it is sharded.
        `compute_dtype`: the trainer's mixed-precision compute dtype (None: not mixed), the
        default of `param_dtype`, with gradients reduced in the parameters' dtype."""
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "Sharding needs torch.distributed initialized (run under torchrun, or "
                "`temper train RECIPE --nproc N`); for one process leave sharding unset"
            )
        self.config = config
        self.world = trainer_world()
        self.dims = config.dims.build(world_size=self.world.size)
        self.dims.check_model(model.config)
        device = device or next(model.parameters()).device
        meshes = self.world.mesh(self.dims.degrees, device_type=device.type)
        self.mesh, self.dp_mesh = meshes.mesh, meshes.dp
        param_dtype, reduce_dtype = config.param_dtype, config.reduce_dtype
        if compute_dtype is not None:
            param_dtype = param_dtype or dtype_name(compute_dtype)
            reduce_dtype = reduce_dtype or dtype_name(next(model.parameters()).dtype)
        family_of_model(model).parallelize(
            model,
            parallel_dims=self.dims,
            mesh=self.mesh,
            expert_mesh=meshes.experts,
            activation_checkpointing=config.activation_checkpointing,
            compile=config.compile,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
        )

    @property
    def dp_rank(self) -> int:
        """Which share of the data this rank trains on (0..dp-1)."""
        return self.dp_mesh.get_local_rank()

    def sum_over_dp(self, value: float) -> float:
        """Sum a per-rank number (e.g. a loss sum) over the data-parallel ranks."""
        # On the mesh's device: NCCL reduces only CUDA tensors (the current device's).
        total = torch.tensor([value], dtype=torch.float64, device=self.dp_mesh.device_type)
        dist.all_reduce(total, group=self.dp_mesh.get_group())
        return float(total.item())

    def sum_tensor_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """`sum_over_dp` of every element of a tensor at once; returned on the CPU."""
        total = tensor.to(self.dp_mesh.device_type, copy=True)
        dist.all_reduce(total, group=self.dp_mesh.get_group())
        return total.cpu()

    def max_over_ranks(self, value: int) -> int:
        result = torch.tensor([value], dtype=torch.int64, device=self.dp_mesh.device_type)
        dist.all_reduce(result, op=dist.ReduceOp.MAX, group=self.world.group)
        return int(result.item())

    def agree_or_raise(self, error: BaseException | None) -> None:
        """Raise on every rank if any rank has `error` (this rank's own error, if it has one)."""
        messages: list[str | None] = [None] * self.world.size
        dist.all_gather_object(
            messages, None if error is None else f"{error}", group=self.world.group
        )
        if error is not None:
            raise error
        failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
        if failed:
            rank, message = failed[0]
            raise ValueError(f"rank {rank} rejected the request: {message}")
