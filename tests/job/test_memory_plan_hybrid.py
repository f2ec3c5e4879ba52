"""`temper plan` for Qwen3.5 (hybrid: Gated DeltaNet + full attention): the generator's KV
cache holds only the full-attention layers and its recurrent-state pool sits beside it, both
equal to what Temper's engine allocates; the published sizes' parameter counts equal
transformers' count of the same config."""

from __future__ import annotations

import pytest
import torch

from temper.job.memory_plan import plan_memory
from temper.job.model_bytes import ModelShapes, SamplerBytes
from temper.job.plan_settings import PlanSettings
from temper.models import materialize
from temper.models.qwen3_5.sizes import QWEN3_5_SIZES, qwen3_5_size
from temper.models.registry import family
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine
from temper.tokenizer import build_builtin_tokenizer

SLOTS, MAX_SEQ_LEN = 6, 96


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planned_generator_bytes_equal_the_engine_allocation(dtype):
    tokenizer = build_builtin_tokenizer("digits")
    config = qwen3_5_size("tiny", vocab_size=tokenizer.vocab_size)
    model = materialize(config, seed=0, dtype=dtype).eval()
    engine = SamplerEngine.Config(
        max_batch=SLOTS, max_seq_len=MAX_SEQ_LEN, cpu=CpuDecoding.Config(processes=1)
    ).build(model=model, tokenizer=tokenizer)
    planned = _planned(config, dtype=dtype)
    assert planned.kv_cache == engine.cache.nbytes  # the one full-attention layer
    assert planned.recurrent_states == engine.cache.states.nbytes
    # By hand: 3 linear layers x 6 slots x (conv [C, 3] in dtype + state [4, 32, 32] fp32).
    conv_channels = 2 * 2 * 32 + 4 * 32
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_slot = 3 * (conv_channels * 3 * itemsize + 4 * 32 * 32 * 4)
    assert planned.recurrent_states == SLOTS * per_slot
    assert planned.kv_cache == 2 * 1 * SLOTS * 2 * MAX_SEQ_LEN * 32 * itemsize


def _planned(config, *, dtype: str) -> SamplerBytes:
    shapes = ModelShapes.of(config, lora_rank=None)
    return SamplerBytes.of(
        config,
        shapes,
        num_slots=SLOTS,
        max_seq_len=MAX_SEQ_LEN,
        dtype=dtype,
        prefix_cache_mib=0,
    )


def test_plan_rows_name_the_state_pool_and_the_attention_layers():
    settings = PlanSettings(model="qwen3_5/4B", nproc_per_node=1, batch=64, max_seq_len=4096)
    plan = plan_memory(settings)
    rows = {row.item: row.num_bytes for row in plan.role("colocated").rows}
    kv = next(item for item in rows if item.startswith("KV cache"))
    assert "8 full-attention layers of 32" in kv
    states = rows["recurrent states: 64 slots x 24 linear-attention layers"]
    # Per slot and layer: conv [8192, 3] bf16 + state [32, 128, 128] fp32 = 2.05 MiB.
    assert states == 64 * 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    assert rows[kv] == 8 * 2 * 64 * 4096 * 4 * 256 * 2


@pytest.mark.parametrize("size", ["4B", "9B", "27B"])
def test_published_parameter_counts_equal_transformers(size):
    transformers = pytest.importorskip("transformers")
    config = QWEN3_5_SIZES[size]
    hf_config = family("qwen3_5").config_to_hf(config, dtype_name="bfloat16")
    text_config = transformers.Qwen3_5TextConfig(**hf_config)
    with torch.device("meta"):
        reference = transformers.Qwen3_5ForCausalLM(text_config)
    expected = sum(parameter.numel() for parameter in reference.parameters())
    assert config.num_params == expected
    plan = plan_memory(PlanSettings(model=f"qwen3_5/{size}", nproc_per_node=1, max_seq_len=512))
    assert plan.num_params == plan.num_active_params == expected
