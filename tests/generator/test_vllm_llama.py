"""The vLLM backend on a Llama 3 model (no q/k norms, llama3 RoPE scaling): vLLM loads what
Temper exports under the HF names, and its greedy tokens and logprobs are Temper's."""

from __future__ import annotations

import dataclasses

import pytest

from temper.api import SamplingParams
from temper.models import llama_size, materialize
from temper.models.common.rope import Llama3RopeScaling
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.tokenizer import build_builtin_tokenizer

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.generator.vllm import VllmGenerator  # noqa: E402

PROMPTS = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1, 6, 2] * 3]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_greedy_tokens_and_logprobs_agree_with_temper(tied):
    tokenizer = build_builtin_tokenizer("digits")
    # Scaled from 16 positions, so the decoded positions lie past the original context.
    scaling = Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
    )
    config = dataclasses.replace(
        llama_size("tiny", vocab_size=tokenizer.vocab_size),
        init_std=0.1,
        tie_embeddings=tied,
        rope_scaling=scaling,
        max_seq_len=64,
    )
    model = materialize(config, seed=5, dtype="float32").eval()
    vllm = VllmGenerator.Config(kv_cache_mib=64).build(model=model, tokenizer=tokenizer)
    try:
        temper = SamplerEngine.Config(max_batch=8, max_seq_len=64).build(
            model=model, tokenizer=tokenizer
        )
        greedy = SamplingParams(max_tokens=16, temperature=0, stop=[])
        requests = [SampleRequest(prompt=p, params=greedy) for p in PROMPTS]
        ours, theirs = temper.generate(requests), vllm.generate(requests)
    finally:
        vllm.close()
    for mine, other in zip(ours, theirs, strict=True):
        for a, b in zip(mine.sequences, other.sequences, strict=True):
            assert a.tokens == b.tokens
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
