"""How the ranks of a job divide the work: data-parallel replicate x shard, tensor parallel.

The world is laid out as a 3-D device mesh `(dp_replicate, dp_shard, tp)`, tp innermost so a
tensor-parallel group sits on neighbouring ranks (one node's fast links). Data parallelism is
one FSDP2 `fully_shard` over the `dp_replicate x dp_shard` sub-mesh: dp_shard alone is FSDP,
dp_replicate alone is DDP (every rank holds whole parameters, gradients are all-reduced), both
is HSDP. Ranks with the same data-parallel coordinate (the members of a tp group) see the same
data.

Checks run before any collective, from the config and the world size alone, so every rank
raises the same ValueError and none is left waiting in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from temper.config.checks import check_range
from temper.config.configurable import Configurable

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


class ParallelDims(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        dp_replicate: int = 1
        """Data-parallel replicas holding whole copies of the (FSDP-sharded) model (DDP/HSDP)."""
        dp_shard: int = -1
        """FSDP shard degree; -1 takes whatever the world size leaves after the other degrees."""
        tp: int = 1
        """Tensor-parallel degree (attention heads and feed-forward width split across ranks)."""

        def __post_init__(self) -> None:
            for name in ("dp_replicate", "tp"):
                value = getattr(self, name)
                check_range(value, field=f"ParallelDims.Config.{name}", integer=True, at_least=1)
            check_range(
                self.dp_shard,
                field="ParallelDims.Config.dp_shard",
                integer=True,
                at_least=1,
                also=(-1,),
                hint="-1: what the world size leaves",
            )

    def __init__(self, config: Config, *, world_size: int) -> None:
        self.config = config
        self.world_size = world_size
        self.dp_replicate, self.tp = config.dp_replicate, config.tp
        fixed = config.dp_replicate * config.tp
        if config.dp_shard == -1:
            if world_size % fixed != 0:
                raise ValueError(
                    f"ParallelDims: world size {world_size} is not divisible by dp_replicate "
                    f"({config.dp_replicate}) x tp ({config.tp}) = {fixed}, so dp_shard=-1 "
                    "cannot be resolved; choose degrees whose product divides the world size"
                )
            self.dp_shard = world_size // fixed
        else:
            self.dp_shard = config.dp_shard
        product = self.dp_replicate * self.dp_shard * self.tp
        if product != world_size:
            raise ValueError(
                f"ParallelDims: dp_replicate ({self.dp_replicate}) x dp_shard ({self.dp_shard}) "
                f"x tp ({self.tp}) = {product}, but the world size is {world_size}; the degrees "
                "must multiply to the number of ranks (dp_shard=-1 fills in the rest)"
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different shares of the data a step processes."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def check_model(self, model_config: Any) -> None:
        """Raise if `model_config` (a DecoderConfig) cannot be split `tp` ways: its heads, and
        the feed-forward width of its dense layers. Routed experts (a MoE config's sparse
        layers) stay whole on every tp rank, so a model whose layers are all sparse never
        splits `ffn_dim`."""
        if not self.tp_enabled:
            return
        fields = ("num_heads", "num_kv_heads")
        if _has_dense_layer(model_config):
            fields += ("ffn_dim",)
        for field in fields:
            value = getattr(model_config, field)
            if value % self.tp != 0:
                valid = ", ".join(f"{name}={getattr(model_config, name)}" for name in fields)
                raise ValueError(
                    f"ParallelDims.Config.tp={self.tp} must divide the model's {field} "
                    f"({value}); valid tp degrees divide {valid}"
                )

    @property
    def degrees(self) -> tuple[int, int, int]:
        """`(dp_replicate, dp_shard, tp)`: the shape of the mesh (world.py builds it)."""
        return (self.dp_replicate, self.dp_shard, self.tp)

    def dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards over: 1-D (dp_shard) for FSDP, 2-D for DDP/HSDP."""
        if self.dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard"]
        return mesh["dp_shard"]

    def __repr__(self) -> str:
        return (
            f"ParallelDims(dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}, "
            f"tp={self.tp}, world_size={self.world_size})"
        )


def _has_dense_layer(model_config: Any) -> bool:
    """Whether some block has a dense feed-forward (TP splits its width). A MoE config says
    which layers are sparse (`is_sparse`); any other decoder is dense throughout."""
    is_sparse = getattr(model_config, "is_sparse", None)
    if is_sparse is None:
        return True
    return not all(is_sparse(index) for index in range(model_config.num_layers))
