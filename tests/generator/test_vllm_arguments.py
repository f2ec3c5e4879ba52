"""vLLM's start-up arguments from Temper's settings (no vLLM or GPU needed): the context and
KV reserve follow the sampler's settings, the memory fraction what the GPU has free, sleep
mode only when sleeping is asked for."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.generator.choice import GeneratorChoice
from temper.generator.vllm import VllmGenerator
from temper.generator.vllm_arguments import (
    GpuMemory,
    LoraSlots,
    engine_arguments,
    kv_bytes_per_token,
)
from temper.job.model import with_vllm_sleep
from temper.models import qwen3_size
from temper.sampler.engine import SamplerEngine

GIB = 2**30
SIZE = qwen3_size("0.6B")


def _arguments(**overrides):
    settings = {
        "model_dir": "/m",
        "model_config": SIZE,
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "max_num_seqs": 64,
        "kv_cache_mib": None,
        "tensor_parallel_size": 1,
        "eager": True,
        "sleep": "off",
        "gpu_memory_fraction": None,
        "tokenizer_given": True,
        "gpu": None,
    }
    return engine_arguments(**{**settings, **overrides})


def test_the_kv_reserve_holds_max_num_seqs_whole_sequences():
    per_token = kv_bytes_per_token(SIZE, dtype=torch.bfloat16)
    assert per_token == 28 * 2 * 8 * 128 * 2  # Qwen3-0.6B: 112 KiB a token
    arguments = _arguments()
    assert arguments["kv_cache_memory_bytes"] == 64 * 2048 * per_token
    assert arguments["max_model_len"] == 2048 and arguments["max_num_seqs"] == 64
    assert _arguments(kv_cache_mib=512)["kv_cache_memory_bytes"] == 512 * 2**20


def test_the_memory_fraction_is_what_is_free_beside_a_trainer():
    gpu = GpuMemory(free_bytes=60 * GIB, total_bytes=80 * GIB)  # a trainer holds 20 GiB
    assert _arguments(gpu=gpu)["gpu_memory_utilization"] == pytest.approx(0.95 * 0.75)
    assert _arguments(gpu=gpu, gpu_memory_fraction=0.5)["gpu_memory_utilization"] == 0.5
    assert "gpu_memory_utilization" not in _arguments()  # CPU: vLLM's CPU build sizes itself
    with pytest.raises(ValueError, match=r"KV cache needs 14.00 GiB.*lower --generator.vllm"):
        _arguments(gpu=GpuMemory(free_bytes=10 * GIB, total_bytes=80 * GIB))


def test_sleep_mode_only_when_asked_for():
    assert "enable_sleep_mode" not in _arguments()
    assert _arguments(sleep="keep_weights")["enable_sleep_mode"] is True
    job_choice = with_vllm_sleep(GeneratorChoice.Config(backend="vllm"))
    assert job_choice.vllm.sleep == "keep_weights"
    dropped = GeneratorChoice.Config(
        backend="vllm", vllm=VllmGenerator.Config(sleep="drop_weights")
    )
    assert with_vllm_sleep(dropped).vllm.sleep == "drop_weights"  # the config's choice stays


def test_a_jobs_vllm_takes_the_samplers_context_and_batch():
    choice = GeneratorChoice(GeneratorChoice.Config(backend="vllm"))
    engine = SamplerEngine.Config(max_batch=32, max_seq_len=1024)
    derived = choice.vllm_config(engine=engine, model_max_seq_len=40960)
    assert (derived.max_model_len, derived.max_num_seqs) == (1024, 32)
    assert choice.vllm_config(engine=engine, model_max_seq_len=512).max_model_len == 512
    explicit = dataclasses.replace(
        choice.config, vllm=VllmGenerator.Config(max_model_len=4096, max_num_seqs=8)
    )
    kept = GeneratorChoice(explicit).vllm_config(engine=engine, model_max_seq_len=40960)
    assert (kept.max_model_len, kept.max_num_seqs) == (4096, 8)


def test_lora_is_enabled_only_for_a_multi_lora_engine():
    assert "enable_lora" not in _arguments()
    slots = LoraSlots(max_loras=4, max_cpu_loras=16, max_lora_rank=32)
    arguments = _arguments(lora=slots)
    assert arguments["enable_lora"] is True
    assert (arguments["max_loras"], arguments["max_cpu_loras"]) == (4, 16)
    assert arguments["max_lora_rank"] == 32


def test_a_lora_rank_vllm_lacks_is_refused_by_name():
    with pytest.raises(ValueError, match=r"VllmGenerator\.Config\.max_lora_rank.*got 12"):
        VllmGenerator.Config(max_lora_rank=12)
