"""What a rank's GPU holds besides tensors of the model: its CUDA context, the buffers of the
NCCL communicators it takes part in, and the memory pool of each engine's CUDA graphs.
memory_plan.py adds them as rows of each role.

Unlike model_bytes.py these do not follow from shapes alone: the context and NCCL's buffers
depend on the driver, NCCL's version and the interconnect. The constants below are documented
estimates; a GPU run's measurements (`make gpu-check`) should replace them. The count of
communicators follows the process groups the code builds (distributed/launch.py,
distributed/placement.py, distributed/world.py), and the graph pool follows the decode step's
shapes.
"""

from __future__ import annotations

from typing import Literal

from temper.models.build import parse_dtype
from temper.models.common.decoder import DecoderConfig
from temper.models.common.moe_decoder import MoEDecoderConfig

Role = Literal["colocated", "trainer", "generator"]

MIB = 2**20

CUDA_CONTEXT_BYTES = 500 * MIB
"""One CUDA context per process (every rank holds one): an estimate for torch with CUDA 12
and lazy module loading on an H100, where the driver, cuBLAS's workspace and the kernels a
job loads take a few hundred MiB. Replace it with what `make gpu-check` measures (what
`nvidia-smi` shows for a process beyond `torch.cuda.memory_reserved()`)."""

NCCL_COMMUNICATOR_BYTES = 256 * MIB
"""GPU memory of one NCCL communicator a rank takes part in, an estimate: NCCL_BUFFSIZE
(4 MiB) per connection x send and receive x up to 32 channels. NVLink SHARP (NVLS) on
8-GPU H100 nodes registers more per communicator (NCCL_NVLS_ENABLE=0 turns it off), and
fewer channels across nodes need less. Replace it with what `make gpu-check` measures."""


def graph_pool_bytes(decoder: DecoderConfig, *, num_slots: int, dtype: str) -> int:
    """The pool of one engine's decode graphs (sampler/cuda_graphs.py): the graphs share it,
    so it holds one step's temporaries at the largest bucket (all `num_slots` slots). Those
    are the logits in the compute dtype and their fp32 copy, and one layer's temporaries
    (reused by the next layer): the feed-forward's (`feed_forward_temporary_bytes`), the
    residual stream, its norm, the attention output and projection, and q, k, v. Attention
    reads the KV cache in place (no copy of it)."""
    itemsize = parse_dtype(dtype).itemsize
    logits = num_slots * decoder.vocab_size * (4 + itemsize)
    qkv = 3 * decoder.num_heads * decoder.head_dim
    feed_forward = feed_forward_temporary_bytes(decoder, itemsize=itemsize)
    layer = num_slots * ((4 * decoder.dim + qkv) * itemsize + feed_forward)
    return logits + layer


def feed_forward_temporary_bytes(decoder: DecoderConfig, *, itemsize: int) -> int:
    """One token's feed-forward temporaries in the largest kind of layer: a dense layer's
    gate and up projections; a sparse layer's router logits and their fp32 softmax, and for
    each of its top_k experts the token's row, its gate and up projections and its output."""
    dense = 2 * decoder.ffn_dim * itemsize
    if not isinstance(decoder, MoEDecoderConfig):
        return dense
    experts = decoder.top_k * (2 * decoder.moe_ffn_dim + 2 * decoder.dim) * itemsize
    sparse = experts + decoder.num_experts * (itemsize + 4)
    kinds = {sparse if decoder.is_sparse(index) else dense for index in range(decoder.num_layers)}
    return max(kinds)


def nccl_communicators(
    role: Role, *, world_size: int, trainer_ranks: int, dp_replicate: int, ep: int = 1
) -> tuple[str, ...]:
    """The NCCL communicators one rank of `role` takes part in, by group. launch.py binds the
    default group to the rank's GPU, so torch creates every group's communicator when the
    group is made. A group of one rank has no peer to keep buffers for, and gloo groups
    (control, requests, the loop's) are not NCCL: neither is listed.

    The trainer's `(dp_replicate, dp_shard, tp)` mesh (world.py) makes a group per dimension
    and one more for the flattened data-parallel dimension; torch reuses the default group
    for one that spans the whole world, so colocated FSDP or DDP adds nothing, and hybrid
    (dp_replicate x dp_shard) adds its two dimensions. Expert parallelism (ep > 1) splits
    dp_shard into (efsdp, ep) for the experts, a group each. A disaggregated trainer's groups never
    span the world: each is a communicator of its own. Weight channels (placement.py): one
    data group per trainer rank, of that rank and every generator rank."""
    if world_size == 1:
        return ()
    if role == "generator":
        return ("default", *(f"weight channel {rank}" for rank in range(trainer_ranks)))
    mesh = tuple(
        f"mesh {name}"
        for name, size in _dp_dims(trainer_ranks, dp_replicate, ep)
        if 1 < size < world_size
    )
    if role == "colocated":
        return ("default", *mesh)
    trainers = ("trainers",) if trainer_ranks > 1 else ()
    return ("default", *trainers, *mesh, "weight channel")


def _dp_dims(trainer_ranks: int, dp_replicate: int, ep: int) -> tuple[tuple[str, int], ...]:
    """The data-parallel mesh dimensions and their sizes (the expert mesh's too), the
    flattened one ('dp') last."""
    shard = trainer_ranks // dp_replicate
    dims = (("dp_replicate", dp_replicate), ("dp_shard", shard))
    if ep > 1:
        dims += (("efsdp", shard // ep), ("ep", ep))
    return (*dims, ("dp", trainer_ranks))
