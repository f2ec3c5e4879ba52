"""vLLM's GPU build: start, sleep and wake up (needs a GPU and the vllm extra; `make gpu-check`
runs it). Sleep mode must give the GPU memory back, and the engine samples the same greedy
tokens after waking as before."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize, qwen3_size
from temper.sampler.requests import SampleRequest
from temper.tokenizer import build_builtin_tokenizer

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

from temper.generator.vllm import VllmGenerator  # noqa: E402


def test_vllm_sleeps_wakes_and_samples_as_before():
    tokenizer = build_builtin_tokenizer("digits")
    config = dataclasses.replace(
        qwen3_size("tiny", vocab_size=tokenizer.vocab_size), head_dim=64, max_seq_len=128
    )
    model = materialize(config, seed=5, dtype="bfloat16").eval()
    generator = VllmGenerator.Config(kv_cache_mib=256, sleep="keep_weights").build(
        model=model, tokenizer=tokenizer
    )
    try:
        greedy = SamplingParams(max_tokens=8, temperature=0.0, stop=[])
        requests = [SampleRequest(prompt=[1, 2, 3 + i], params=greedy) for i in range(4)]
        before = [r.sequences[0].tokens for r in generator.generate(requests)]
        free = torch.cuda.mem_get_info()[0]
        generator.sleep()
        assert torch.cuda.mem_get_info()[0] - free > 128 * 2**20  # the KV cache, at least
        generator.wake_up()
        assert [r.sequences[0].tokens for r in generator.generate(requests)] == before
    finally:
        generator.close()
