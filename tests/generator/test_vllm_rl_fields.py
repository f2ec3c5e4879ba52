"""The RL fields on vLLM's CPU build against Temper's engine and full-forward references:
target prompt logprobs (both answer paths), the sampled tokens' support, and routed experts
refused with the reason. `make test-vllm` runs these."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from temper.api import SamplingParams
from temper.api.prompt_targets import PromptTargets
from temper.generator import vllm_fields
from temper.models import materialize, qwen3_moe_size, qwen3_size
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.sampler.support import support_of_logits
from temper.tokenizer import build_builtin_tokenizer

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.generator.vllm import VllmGenerator  # noqa: E402

TOLERANCE = 1e-5  # fp32: KV-cache decode vs a full forward differ by ~1e-6 here
PROMPTS = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1, 6, 2]]


@pytest.fixture(scope="module")
def backends():
    tokenizer = build_builtin_tokenizer("digits")
    config = dataclasses.replace(
        qwen3_size("tiny", vocab_size=tokenizer.vocab_size),
        init_std=0.1,
        tie_embeddings=True,
        max_seq_len=64,
    )
    model = materialize(config, seed=5, dtype="float32").eval()
    vllm = VllmGenerator.Config(kv_cache_mib=64).build(model=model, tokenizer=tokenizer)
    temper = SamplerEngine.Config(max_batch=64, max_seq_len=64).build(
        model=model, tokenizer=tokenizer
    )
    yield vllm, temper, model
    vllm.close()


def test_target_prompt_logprobs_agree_with_temper(backends):
    vllm, temper, _ = backends
    prompt = PROMPTS[2]
    generator = torch.Generator().manual_seed(0)
    ids_RK = torch.randint(0, vllm.vocab_size, (len(prompt) - 1, 3), generator=generator)
    ids_RK[1, 2] = ids_RK[4, 0] = -1  # cells naming nothing answer 0.0
    targets = PromptTargets.from_ids(ids_RK)
    request = SampleRequest(
        prompt=prompt, params=SamplingParams(max_tokens=2), target_prompt_logprobs=targets
    )
    (ours,), (theirs,) = temper.generate([request]), vllm.generate([request])
    assert theirs.target_prompt_logprobs.shape == targets.shape
    assert (
        theirs.target_prompt_logprobs.to_torch() - ours.target_prompt_logprobs.to_torch()
    ).abs().max() < TOLERANCE
    # The GPU runner's answer, a [R, K] table of these ids' logprobs, converts to the same.
    native_RK = theirs.target_prompt_logprobs.to_torch().masked_fill(ids_RK < 0, float("-inf"))
    converted = vllm_fields.target_logprobs(
        SimpleNamespace(prompt_token_id_logprobs=native_RK.numpy()), targets
    )
    assert converted == theirs.target_prompt_logprobs


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 29, 0.9), (0.7, 5, 1.0), (1.3, 8, 0.8)]
)
def test_support_is_temper_sampling_transforms_kept_set(backends, temperature, top_k, top_p):
    vllm, _, model = backends
    params = SamplingParams(
        max_tokens=8,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=3,
        stop=[],
        return_support=True,
    )
    responses = vllm.generate(
        [SampleRequest(prompt=p, params=params, num_samples=2) for p in PROMPTS]
    )
    for prompt, response in zip(PROMPTS, responses, strict=True):
        for sequence in response.sequences:
            with torch.no_grad():
                tokens = torch.tensor([prompt + sequence.tokens[:-1]])
                logits_TV = model(tokens)[0, len(prompt) - 1 :].float()
            assert sequence.support == support_of_logits(logits_TV, params)
            # The sampled logprob is the logits' softmax renormalised over that support.
            for row, (token, logprob, kept) in enumerate(
                zip(sequence.tokens, sequence.logprobs, sequence.support, strict=True)
            ):
                scaled_V = logits_TV[row] / temperature
                expected = scaled_V[token] - torch.logsumexp(scaled_V[kept], 0)
                assert abs(logprob - float(expected)) < TOLERANCE


def test_both_backends_return_the_same_support_when_the_draw_is_determined(backends):
    vllm, temper, _ = backends
    # top_k 1 at temperature > 0: the argmax, whichever random stream draws it.
    params = SamplingParams(max_tokens=6, temperature=0.8, top_k=1, stop=[], return_support=True)
    requests = [SampleRequest(prompt=p, params=params) for p in PROMPTS]
    for ours, theirs in zip(temper.generate(requests), vllm.generate(requests), strict=True):
        a, b = ours.sequences[0], theirs.sequences[0]
        assert a.tokens == b.tokens and a.support == b.support == [[t] for t in a.tokens]
        assert max(abs(x) for x in a.logprobs + b.logprobs) == 0.0
    plain = vllm.generate([SampleRequest(prompt=PROMPTS[0], params=SamplingParams(max_tokens=2))])
    assert plain[0].sequences[0].support is None  # only when asked


def test_support_without_top_k_is_refused_and_the_engine_keeps_serving(backends):
    vllm, temper, _ = backends
    params = SamplingParams(max_tokens=2, top_p=0.9, return_support=True)
    with pytest.raises(ValueError, match="return_support on the vllm backend needs top_k >= 1"):
        vllm.generate([SampleRequest(prompt=[1, 2], params=params)])
    assert temper.generate([SampleRequest(prompt=[1, 2], params=params)])[0].sequences[0].support
    assert vllm.generate([SampleRequest(prompt=[1, 2])])[0].sequences[0].tokens


def test_record_routes_on_cpu_is_refused_with_the_reason():
    tokenizer = build_builtin_tokenizer("digits")
    config = dataclasses.replace(
        qwen3_moe_size("tiny", vocab_size=tokenizer.vocab_size), max_seq_len=32
    )
    model = materialize(config, seed=1, dtype="float32").eval()
    with pytest.raises(ValueError, match="Model Runner V2 only, which needs Triton"):
        VllmGenerator.Config(kv_cache_mib=16, record_routes=True).build(model=model)
