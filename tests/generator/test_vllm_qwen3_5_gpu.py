"""vLLM's CUDA build on a Qwen3.5 model (needs a GPU and the vllm extra; `make gpu-check` runs
it): greedy tokens are Temper's full-forward argmax and logprobs close, in bf16 and fp32,
with the delta-rule state kept in fp32 and the hybrid prefix cache on; new weights reach the
hybrid layers through the weight-transfer path."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize
from temper.models.qwen3_5.sizes import qwen3_5_size
from temper.sampler.requests import SampleRequest
from temper.tokenizer import build_builtin_tokenizer

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

from temper.generator.vllm import VllmGenerator  # noqa: E402

PROMPTS = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1, 6, 2] * 3]
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-3}  # Triton kernels in fp32 use tf32 matmuls


def _model(*, dtype: str, seed: int):
    tokenizer = build_builtin_tokenizer("digits")
    config = dataclasses.replace(
        qwen3_5_size("tiny", vocab_size=tokenizer.vocab_size),
        max_seq_len=64,
        head_dim=64,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    )
    return materialize(config, seed=seed, dtype=dtype).eval(), tokenizer


def _check(generator, model, *, tolerance: float) -> None:
    """vLLM's greedy tokens against Temper's full (chunked) forward in fp32 on the same
    weights: each is its argmax up to near-ties, with a close logprob."""
    greedy = SamplingParams(max_tokens=12, temperature=0, stop=[])
    responses = generator.generate([SampleRequest(prompt=p, params=greedy) for p in PROMPTS])
    reference = copy.deepcopy(model).float()
    for prompt, response in zip(PROMPTS, responses, strict=True):
        sampled = response.sequences[0].tokens
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + sampled[:-1]]))[0, len(prompt) - 1 :]
        logprobs_TV = logits.log_softmax(-1)
        chosen = logprobs_TV.gather(-1, torch.tensor(sampled)[:, None])[:, 0]
        assert (logprobs_TV.max(-1).values - chosen).max().item() < tolerance
        sampled_logprobs = torch.tensor(response.sequences[0].logprobs)
        assert (sampled_logprobs - chosen).abs().max().item() < tolerance


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_qwen3_5_greedy_logprobs_and_weight_update_on_cuda(dtype):
    model, tokenizer = _model(dtype=dtype, seed=5)
    generator = VllmGenerator.Config(kv_cache_mib=256).build(model=model, tokenizer=tokenizer)
    try:
        _check(generator, model, tolerance=TOLERANCE[dtype])
        other, _ = _model(dtype=dtype, seed=11)
        generator.update_weights(other.state_dict(), version=1)
        _check(generator, other, tolerance=TOLERANCE[dtype])
    finally:
        generator.close()
