"""The arguments a vLLM `LLM` is started with, from Temper's settings and the model's shapes.

Kept apart from the backend so that they can be checked without vLLM or a GPU:
- A hybrid model's reserve holds its full-attention layers' keys and values and its
  linear-attention layers' states (generator/vllm_hybrid.py).
- Context and KV reserve follow the sampler's settings when the generator is chosen through
  `GeneratorChoice` (max_seq_len, max_batch), so vLLM reserves what Temper's engine would for
  the same job: room for `max_num_seqs` whole sequences. A model's own context (40,960 tokens
  at Qwen3's sizes) would need more KV for one sequence than a 256 MiB reserve holds.
- vLLM's start-up check wants `gpu_memory_utilization` x the card's memory free when it
  starts (0.9 unless told): false beside a colocated trainer. The fraction passed is what is
  free at start, less a margin, unless set.
- Sleep mode (vLLM's own allocator, which `sleep()` releases) is on only when sleeping is
  asked for: without it `sleep()` frees nothing, and with it vLLM allows one such engine a
  process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from temper.generator import vllm_hybrid
from temper.models.common.decoder import DecoderConfig

DEFAULT_MAX_NUM_SEQS = 256
"""Sequences vLLM decodes at once when built directly (not through GeneratorChoice)."""
GPU_FREE_MARGIN = 0.95
"""Share of the GPU memory free at start that vLLM may count on (the rest: other threads'
allocations racing its start)."""
SleepMode = Literal["off", "keep_weights", "drop_weights"]
SLEEP_LEVELS = {"keep_weights": 1, "drop_weights": 2}
"""vLLM's sleep levels: 1 moves the weights to host memory and drops the KV cache; 2 drops
both (for when new weights are loaded after every wake-up anyway)."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes as `max_lora_rank` (its LoRA kernels' widths)."""


@dataclass(frozen=True)
class LoraSlots:
    """vLLM's LoRA settings for an engine that serves adapters (generator/vllm_lora.py)."""

    max_loras: int
    """Adapters in one batch (vLLM's device slots)."""
    max_cpu_loras: int
    """Adapters vLLM keeps loaded in host memory; more evicts the least recently used."""
    max_lora_rank: int
    """Widest adapter rank (one of VLLM_LORA_RANKS)."""


@dataclass(frozen=True)
class GpuMemory:
    """The GPU's memory when the engine starts."""

    free_bytes: int
    total_bytes: int

    @classmethod
    def now(cls) -> GpuMemory | None:
        """This process's current GPU's free and total memory; None without a GPU."""
        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info()
        return cls(free_bytes=free, total_bytes=total)


def kv_bytes_per_token(config: DecoderConfig, *, dtype: torch.dtype) -> int:
    """Keys and values of one token over every layer that has them (a hybrid model's
    full-attention layers)."""
    element = torch.empty((), dtype=dtype).element_size()
    layers = len(config.attention_layers) if vllm_hybrid.is_hybrid(config) else config.num_layers
    return layers * 2 * config.num_kv_heads * config.head_dim * element


def engine_arguments(
    *,
    model_dir: str,
    model_config: DecoderConfig,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    kv_cache_mib: int | None,
    tensor_parallel_size: int,
    eager: bool,
    sleep: SleepMode,
    gpu_memory_fraction: float | None,
    tokenizer_given: bool,
    gpu: GpuMemory | None,
    lora: LoraSlots | None = None,
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` (see the module docstring for how each is chosen)."""
    if kv_cache_mib is None:
        torch_dtype = getattr(torch, dtype)
        per_token = kv_bytes_per_token(model_config, dtype=torch_dtype)
        states = vllm_hybrid.state_bytes_per_sequence(model_config, dtype=torch_dtype)
        kv_bytes = max_num_seqs * (max_model_len * per_token + states)
    else:
        kv_bytes = kv_cache_mib * 2**20
    arguments: dict[str, Any] = {
        "model": model_dir,
        "skip_tokenizer_init": not tokenizer_given,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "tensor_parallel_size": tensor_parallel_size,
        "kv_cache_memory_bytes": kv_bytes,
        "max_num_seqs": max_num_seqs,
        "enforce_eager": eager,
        "logprobs_mode": "processed_logprobs",
        "max_logprobs": -1,
        "enable_prefix_caching": True,
        **vllm_hybrid.engine_arguments(model_config),
    }
    if sleep != "off":
        arguments["enable_sleep_mode"] = True
    if lora is not None:
        arguments.update(
            enable_lora=True,
            max_loras=lora.max_loras,
            max_cpu_loras=lora.max_cpu_loras,
            max_lora_rank=lora.max_lora_rank,
        )
    if gpu is not None:
        fraction = gpu_memory_fraction
        if fraction is None:
            fraction = GPU_FREE_MARGIN * gpu.free_bytes / gpu.total_bytes
        needed = kv_bytes / gpu.total_bytes
        if fraction <= needed:
            raise ValueError(
                f"vLLM's KV cache needs {kv_bytes / 2**30:.2f} GiB, {needed:.1%} of the GPU, but "
                f"only {fraction:.1%} is free for it ({gpu.free_bytes / 2**30:.1f} of "
                f"{gpu.total_bytes / 2**30:.1f} GiB free): lower --generator.vllm.kv_cache_mib, "
                "--sampler.max_batch or --sampler.max_seq_len, or free the GPU"
            )
        arguments["gpu_memory_utilization"] = round(fraction, 4)
    return arguments
