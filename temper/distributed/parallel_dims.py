"""How the ranks of a job divide the work: data-parallel replicate x shard, tensor parallel,
expert parallel.

The world is laid out as a 3-D device mesh `(dp_replicate, dp_shard, tp)`, tp innermost so a
tensor-parallel group sits on neighbouring ranks (one node's fast links). Data parallelism is
one FSDP2 `fully_shard` over the `dp_replicate x dp_shard` sub-mesh: dp_shard alone is FSDP,
dp_replicate alone is DDP (every rank holds whole parameters, gradients are all-reduced), both
is HSDP. Ranks with the same data-parallel coordinate (the members of a tp group) see the same
data.

Expert parallelism borrows its ranks from dp_shard (as torchtitan's does): for routed experts
the dp_shard dimension is split into `(efsdp, ep)`, ep innermost, giving the expert mesh
`(dp_replicate, efsdp, ep, tp)`. Each ep group (ep neighbouring dp_shard ranks, which train on
different data) splits a layer's experts into ep equal parts and exchanges tokens with
all-to-all (expert_parallel.py); FSDP shards each part further over efsdp = dp_shard / ep
(and replicates it over dp_replicate). So a rank still holds 1/dp_shard of the expert weights
between steps, as under FSDP alone, but gathers only its ep group's part of a layer's experts
when it runs them, not all of them. Everything else in the model is sharded as without EP.
Tensor-parallel ranks see the same tokens, so they are not borrowed: each tp rank runs its own
ep groups on the same data, experts whole along tp as without EP.

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
EXPERT_MESH_DIMS = ("dp_replicate", "efsdp", "ep", "tp")


class ParallelDims(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        dp_replicate: int = 1
        """Data-parallel replicas holding whole copies of the (FSDP-sharded) model (DDP/HSDP)."""
        dp_shard: int = -1
        """FSDP shard degree; -1 takes whatever the world size leaves after the other degrees."""
        tp: int = 1
        """Tensor-parallel degree (attention heads and feed-forward width split across ranks)."""
        ep: int = 1
        """Expert-parallel degree (MoE models): each layer's routed experts are split into ep
        parts over ep of the dp_shard ranks, tokens sent to their experts' rank with
        all-to-all; must divide dp_shard and the model's num_experts. 1: experts are sharded
        by FSDP like every other weight (all of a layer's gathered on every rank)."""

        def __post_init__(self) -> None:
            for name in ("dp_replicate", "tp", "ep"):
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
        self.ep = config.ep
        if self.dp_shard % self.ep != 0:
            raise ValueError(
                f"ParallelDims.Config.ep={self.ep} must divide dp_shard ({self.dp_shard}: world "
                f"size {world_size} / (dp_replicate {self.dp_replicate} x tp {self.tp})); "
                "expert parallelism borrows its ranks from dp_shard; valid ep degrees divide "
                f"{self.dp_shard}"
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

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """FSDP degree of the routed experts under expert parallelism: dp_shard / ep."""
        return self.dp_shard // self.ep

    def check_model(self, model_config: Any) -> None:
        """Raise if `model_config` (a DecoderConfig) cannot be split as the degrees say: `tp`
        ways its heads (a hybrid model's linear-attention key and value heads too) and the
        feed-forward width of its dense layers (routed experts stay
        whole on every tp rank, so a model whose layers are all sparse never splits
        `ffn_dim`), `ep` ways its routed experts."""
        if self.ep_enabled:
            num_experts = getattr(model_config, "num_experts", None)
            if num_experts is None:
                raise ValueError(
                    f"ParallelDims.Config.ep={self.ep} needs a model with routed experts (a MoE "
                    f"family), got a dense {type(model_config).__qualname__}; use ep=1"
                )
            if num_experts % self.ep != 0:
                valid = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
                raise ValueError(
                    f"ParallelDims.Config.ep={self.ep} must divide the model's num_experts "
                    f"({num_experts}); valid ep degrees divide it: {valid} (and dp_shard)"
                )
        if not self.tp_enabled:
            return
        fields = ("num_heads", "num_kv_heads")
        if getattr(model_config, "linear_layers", ()):  # Gated DeltaNet heads split too
            fields += ("linear_num_key_heads", "linear_num_value_heads")
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
    def degrees(self) -> MeshDegrees:
        """The shape of the meshes (world.py builds them)."""
        return MeshDegrees(
            dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp, ep=self.ep
        )

    def dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards over: 1-D (dp_shard) for FSDP, 2-D for DDP/HSDP."""
        if self.dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard"]
        return mesh["dp_shard"]

    def expert_dp_mesh(self, expert_mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards routed experts over under expert parallelism: 1-D (efsdp),
        2-D with dp_replicate (HSDP)."""
        if self.dp_replicate > 1:
            return expert_mesh["dp_replicate", "efsdp"]
        return expert_mesh["efsdp"]

    def __repr__(self) -> str:
        return (
            f"ParallelDims(dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}, "
            f"tp={self.tp}, ep={self.ep}, world_size={self.world_size})"
        )


@dataclass(frozen=True, kw_only=True)
class MeshDegrees:
    """The degrees the trainer's meshes are built from: the mesh `(dp_replicate, dp_shard, tp)`
    and, with ep > 1, the expert mesh `(dp_replicate, dp_shard / ep, ep, tp)` made from it."""

    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1

    @property
    def shape(self) -> tuple[int, int, int]:
        """The shape of the mesh, in MESH_DIMS order."""
        return (self.dp_replicate, self.dp_shard, self.tp)

    @property
    def expert_shape(self) -> tuple[int, int, int, int]:
        """The shape of the expert mesh, in EXPERT_MESH_DIMS order."""
        return (self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp)


def _has_dense_layer(model_config: Any) -> bool:
    """Whether some block has a dense feed-forward (TP splits its width). A MoE config says
    which layers are sparse (`is_sparse`); any other decoder is dense throughout."""
    is_sparse = getattr(model_config, "is_sparse", None)
    if is_sparse is None:
        return True
    return not all(is_sparse(index) for index in range(model_config.num_layers))
