"""What a memory plan is computed from (`PlanSettings`), with the checks of each setting.

A job's settings come from its configs (`job/placement.plan_settings`); `temper plan` reads a
recipe's. What the plan counts from them is written in memory_plan.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from temper.checkpoint.model_source import DType
from temper.config.checks import check_choice, check_range
from temper.models.build import parse_dtype
from temper.sampler.engine import SamplerEngine
from temper.trainer.engine import TrainerEngine
from temper.trainer.precision import Precision

Placement = Literal["colocated", "disaggregated"]
WeightSyncMode = Literal["bucketed", "whole"]


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """What a memory plan is computed from: a job's configs read by `plan_settings`
    (job/placement.py), the one mapping `temper plan RECIPE` and a job's startup log share."""

    model: str
    """A model directory (its config.json is read, not its weights) or a named size
    (client/named_models.py): a HF repo id ('Qwen/Qwen3-8B', 'meta-llama/Llama-3.1-8B',
    'Qwen/Qwen3-30B-A3B'), FAMILY/SIZE ('llama/8B', 'qwen3_moe/tiny') or a Qwen3 size alone
    ('8B', 'tiny')."""
    lora_rank: int | None = None
    """LoRA rank (attention, MLP and unembedding adapted); None trains every weight."""
    dtype: Literal["auto", "float32", "bf16-mixed", "bfloat16"] = "bfloat16"
    """The trainer's precision (--model.dtype, trainer/precision.py): 'bf16-mixed' keeps fp32
    weights, gradients and AdamW moments and computes in bf16; 'float32' and 'bfloat16' keep
    and compute everything in that dtype; 'auto' plans a GPU's default, 'bf16-mixed'."""
    generator_dtype: DType | None = None
    """The generator's weights and KV cache; None: the trainer's compute dtype."""
    transfer_dtype: DType | None = None
    """Dtype of the weights sent to the generator; None: the generator's."""
    nnodes: int = 1
    """Machines."""
    nproc_per_node: int = 8
    """Ranks (GPUs) per machine; the world size is nnodes x nproc_per_node."""
    placement: Placement = "colocated"
    """colocated: every rank trains a shard and generates; disaggregated: `generator_ranks`
    ranks generate and the others train."""
    generator_ranks: int | None = None
    """disaggregated: ranks that only generate (the rest train); None: 1 when disaggregated
    (as `temper train`'s --placement.generator_ranks), 0 when colocated."""
    generator_tp: int = 1
    """disaggregated: tensor-parallel degree of each generator engine."""
    dp_replicate: int = 1
    """Trainer ranks in whole-model groups (--sharding.dims.dp_replicate): weights, gradients
    and AdamW moments are sharded over trainer ranks / dp_replicate (FSDP when 1; DDP, whole
    copies on every rank, when it equals the trainer ranks)."""
    ep: int = 1
    """Expert-parallel degree of the trainer (--sharding.dims.ep; MoE models): each layer's
    routed experts are split into ep parts over ep of the shard ranks, so a rank gathers one
    part to run a layer, not all of its experts; must divide trainer ranks / dp_replicate and
    the model's num_experts."""
    batch: int = 256
    """Sequences sampled per step, over all generators (rl.prompts_per_step x rl.group_size)."""
    max_seq_len: int = 2048
    """Longest prompt + completion (--sampler.max_seq_len): KV-cache positions per slot and
    tokens per trained sequence."""
    max_batch: int | None = None
    """KV-cache slots of each generator engine (--sampler.max_batch); the engine allocates
    them all up front. None: the engine's share of `batch`."""
    prefix_cache_mib: float = SamplerEngine.Config.prefix_cache_mib
    """The most each generator engine's prefix cache holds (--sampler.prefix_cache_mib)."""
    micro_batch_tokens: int = TrainerEngine.Config.max_tokens_per_microbatch
    """Padded tokens per forward/backward (--trainer.max_tokens_per_microbatch)."""
    activation_checkpointing: Literal["none", "full"] = "none"
    """--sharding.activation_checkpointing: 'full' keeps only each block's input."""
    weight_sync: WeightSyncMode = "bucketed"
    """bucketed: weights streamed in `bucket_mb` buckets (what jobs run); whole: every rank
    gathers whole weights (`sampler_state_dict`)."""
    bucket_mb: int = 256
    """Size of one weight-sync bucket in MiB."""
    overlap_sync: bool = False
    """disaggregated: generators receive new weights into a second copy while they sample
    (--placement.overlap_sync)."""
    mode: Literal["sync", "async"] = "sync"
    """async: colocated ranks keep the previous version's sampler while the next samples."""
    kl_reference: bool = False
    """A KL penalty's reference policy (rl.kl_coef > 0): one more sampler."""
    device: Literal["cuda", "cpu"] = "cuda"
    """What the ranks run on: 'cpu' (a job's startup log on CPU) counts no CUDA context, NCCL
    buffers or CUDA graph pools."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU in GiB (an '80 GB' H100 or A100 reports about 79 GiB)."""
    headroom: float = 0.05
    """Share of GPU memory kept free for what the plan does not count (prefill and decode
    scratch, the allocator's fragmentation)."""

    def __post_init__(self) -> None:
        check_range(self.prefix_cache_mib, field="prefix_cache_mib", at_least=0)
        positive = ("nnodes", "nproc_per_node", "generator_tp", "dp_replicate", "ep", "batch")
        positive += ("max_seq_len", "micro_batch_tokens", "bucket_mb")
        for name in positive:
            check_range(getattr(self, name), field=name, integer=True, at_least=1)
        for name in ("lora_rank", "max_batch"):
            check_range(getattr(self, name), field=name, integer=True, at_least=1, also=(None,))
        # A plan is of GPU memory: 'auto' as on a GPU. Resolved once: frozen from here on.
        precision = Precision.resolve(self.dtype, device="cuda", field="dtype")
        object.__setattr__(self, "dtype", precision.name)
        for name in ("generator_dtype", "transfer_dtype"):
            if getattr(self, name) is not None:
                parse_dtype(getattr(self, name), field=name)
        check_choice(self.placement, field="placement", choices=("colocated", "disaggregated"))
        check_choice(self.weight_sync, field="weight_sync", choices=("bucketed", "whole"))
        check_choice(self.mode, field="mode", choices=("sync", "async"))
        check_choice(self.device, field="device", choices=("cuda", "cpu"))
        check_choice(
            self.activation_checkpointing,
            field="activation_checkpointing",
            choices=("none", "full"),
        )
        check_range(self.gpu_memory_gib, field="gpu_memory_gib", greater_than=0)
        check_range(self.headroom, field="headroom", at_least=0, less_than=1)
        self._check_placement()
        self._check_replicas()

    def _check_placement(self) -> None:
        world = self.world_size
        if self.generator_ranks is None:  # resolved once: frozen from here on
            ranks = 1 if self.placement == "disaggregated" else 0
            object.__setattr__(self, "generator_ranks", ranks)
        if self.placement == "colocated":
            if self.generator_ranks != 0 or self.generator_tp != 1:
                raise ValueError(
                    f"generator_ranks={self.generator_ranks} and generator_tp="
                    f"{self.generator_tp} are for placement 'disaggregated'; with 'colocated' "
                    "every rank generates with whole weights (leave them at 0 and 1)"
                )
            return
        if not 1 <= self.generator_ranks < world:
            raise ValueError(
                f"generator_ranks={self.generator_ranks} must be in 1..{world - 1} with "
                f"placement 'disaggregated' on {world} ranks (nnodes {self.nnodes} x "
                f"nproc_per_node {self.nproc_per_node}): at least one rank generates and one "
                "trains"
            )
        if self.generator_ranks % self.generator_tp:
            raise ValueError(
                f"generator_tp={self.generator_tp} must divide generator_ranks="
                f"{self.generator_ranks} (each engine spans generator_tp ranks)"
            )

    def _check_replicas(self) -> None:
        if self.trainer_ranks % self.dp_replicate:
            raise ValueError(
                f"dp_replicate={self.dp_replicate} must divide the {self.trainer_ranks} trainer "
                "ranks (each whole-model group shards over trainer ranks / dp_replicate)"
            )
        if self.shard_ranks % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide the {self.shard_ranks} ranks each copy of the "
                f"weights is sharded over ({self.trainer_ranks} trainer ranks / dp_replicate "
                f"{self.dp_replicate}): expert parallelism borrows its ranks from them"
            )

    @property
    def shard_ranks(self) -> int:
        """Ranks one copy of the trainer's weights is sharded over."""
        return self.trainer_ranks // self.dp_replicate

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def trainer_ranks(self) -> int:
        return self.world_size - self.generator_ranks

    @property
    def num_engines(self) -> int:
        """Generator engines: one per rank colocated, one per tp group disaggregated."""
        if self.placement == "colocated":
            return self.world_size
        return self.generator_ranks // self.generator_tp
