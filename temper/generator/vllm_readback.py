"""The weights a running vLLM engine holds, read back whole in Temper's names (checks only).

A generator rank keeps no copy of the weights it loads into vLLM, so a check that vLLM holds
exactly the trainer's weights reads them out of vLLM's model: every worker sends its
parameters (`collective_rpc` of `TemperWorkerExtension.temper_weight_shards`), and this
module undoes vLLM's layout. vLLM packs some HF
tensors into one parameter (its model class's `packed_modules_mapping`, e.g. q/k/v into
`qkv_proj`, in the sizes of the layer's `output_sizes`), splits column-parallel layers and the
vocabulary-parallel embedding by rows over tensor-parallel workers and row-parallel layers by
columns, and pads the vocabulary. vLLM's CPU build packs a linear layer's weight for its GEMM
kernel and drops the parameter: such a weight is read by running the layer's own kernel on
the identity matrix (each output is one weight times 1 plus zeros: exact in any float
dtype), so what comes back is what the kernel computes with. Dense models only: vLLM's
fused MoE experts have a layout of their own, refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from temper.models.registry import ModelFamily

Shard = tuple[int | None, str, list[int], bytes]
"""One worker's part of a HF tensor: the dimension it is split along (None: replicated), its
dtype, shape and bytes (what vLLM's RPC returns intact)."""


def read_weights(
    llm: Any, *, family: ModelFamily, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Every tensor of `shapes` (Temper names) as vLLM holds it, on CPU."""
    per_worker: list[dict[str, Shard]] = llm.collective_rpc("temper_weight_shards")
    weights: dict[str, torch.Tensor] = {}
    for hf_name, (dim, *_) in per_worker[0].items():
        key = family.key_from_hf(hf_name)
        if key is None:
            continue
        parts = [_tensor(shards[hf_name]) for shards in per_worker]
        weights[key] = parts[0] if dim is None else torch.cat(parts, dim=dim)
    missing = sorted(shapes.keys() - weights.keys())
    if missing:
        raise ValueError(f"reading weights back from vLLM: its model has no {missing}")
    return {key: weights[key] for key in shapes}


def worker_shards(worker: Any) -> dict[str, Shard]:
    """Runs in each vLLM worker: its parameters by HF name, unpacked and unpadded."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    model = worker.get_model()
    packed = getattr(type(model), "packed_modules_mapping", {})
    shards: dict[str, Shard] = {}
    for name, parameter in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        value = parameter.detach().to("cpu", copy=True)
        if value.numel() == 0 and hasattr(module, "cpu_linear"):
            value = _probed(module)
        # (by the layer's kind: a packed weight's stand-in has no attributes)
        if isinstance(module, RowParallelLinear):
            dim = 1 if leaf == "weight" else None  # its bias is whole on every worker
        elif isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            dim = 0
        else:
            dim = None
        if isinstance(module, VocabParallelEmbedding):
            indices = module.shard_indices
            value = value[: indices.org_vocab_end_index - indices.org_vocab_start_index]
        prefix, _, short = module_name.rpartition(".")
        if short not in packed:
            shards[name] = _shard(dim, value)
            continue
        if getattr(module, "num_kv_head_replicas", 1) > 1:
            raise ValueError(
                f"reading weights back from vLLM: {module_name} repeats key/value heads over "
                "tensor-parallel workers (more workers than key/value heads), not supported"
            )
        sizes = [size // module.tp_size for size in module.output_sizes]
        for sub, part in zip(packed[short], value.split(sizes, dim=0), strict=True):
            shards[f"{prefix}.{sub}.{leaf}"] = _shard(dim, part)
    return shards


def _probed(module: torch.nn.Module) -> torch.Tensor:
    """A CPU-packed linear layer's weight [out, in], through its kernel on the identity."""
    identity = torch.eye(module.input_size_per_partition, dtype=module.params_dtype)
    with torch.no_grad():
        transposed = module.cpu_linear(identity, module.weight, None)
    return transposed.t().contiguous()


def _shard(dim: int | None, value: torch.Tensor) -> Shard:
    flat = value.contiguous().reshape(-1).view(torch.uint8)
    return dim, str(value.dtype).removeprefix("torch."), list(value.shape), flat.numpy().tobytes()


def _tensor(shard: Shard) -> torch.Tensor:
    _, dtype, shape, data = shard
    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)
