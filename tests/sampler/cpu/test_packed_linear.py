"""Prepacked (oneDNN) linear weights for CPU decoding: the same numbers as the model's own
layers (and MoE experts) in bf16, and re-packed whenever the weights change, in place or by an
update."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from temper.api import SamplingParams
from temper.models import materialize, qwen3_moe_size, qwen3_size
from temper.models.common.moe import GroupedExperts
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.cpu.packed_linear import PackedExperts, PackedLinear, packing_available
from temper.sampler.engine import SamplerEngine, SampleRequest

pytestmark = pytest.mark.skipif(
    not packing_available(torch.float32), reason="torch built without oneDNN"
)
needs_bf16_packing = pytest.mark.skipif(
    not packing_available(torch.bfloat16), reason="oneDNN cannot pack bf16 on this CPU"
)

PROMPTS = [[3, 4, 5], [7], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9], [2, 2, 2, 2, 2]]


def _model(*, seed=5, dtype="bfloat16", tie_embeddings=True, size=qwen3_size):
    config = dataclasses.replace(
        size("tiny", vocab_size=31), init_std=0.1, tie_embeddings=tie_embeddings
    )
    return materialize(config, seed=seed, dtype=dtype).eval()


def _engine(model, **cpu):
    config = SamplerEngine.Config(
        max_batch=4, max_seq_len=64, cpu=CpuDecoding.Config(**{"processes": 1, **cpu})
    )
    return config.build(model=model)


def _generate(model, **cpu):
    engine = _engine(model, **cpu)
    requests = [
        SampleRequest(prompt=p, params=SamplingParams(max_tokens=10, seed=i, temperature=0.8))
        for i, p in enumerate(PROMPTS)
    ]
    return engine, [r.sequences[0] for r in engine.generate(requests)]


@needs_bf16_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch_hint", [1, 8])
def test_bf16_packed_linear_is_bitwise_the_linear(bias, batch_hint):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear.weight, bias=linear.bias, batch_hint=batch_hint)
    for shape in [(1, 96), (3, 96), (8, 96), (13, 1, 96)]:
        x = torch.randn(shape, dtype=torch.bfloat16)
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias)), shape


@needs_bf16_packing
@pytest.mark.parametrize("batch_hint", [1, 64])
def test_bf16_packed_experts_are_bitwise_the_experts(batch_hint):
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts=5, dim=64, hidden_dim=96)
    for parameter in experts.parameters():
        nn.init.normal_(parameter, std=0.1)
    experts = experts.to(torch.bfloat16)
    packed = PackedExperts(experts, batch_hint=batch_hint)
    # Rows sorted by expert: experts without rows, one row, many, all rows on one expert.
    for counts in ([3, 0, 1, 17, 2], [0, 0, 13, 0, 0], [1, 1, 1, 1, 1], [0] * 5):
        x_AD = torch.randn(sum(counts), 64).to(torch.bfloat16)
        with torch.no_grad():
            expected_AD = experts(x_AD, counts_E=counts, offsets_E=None)
        assert torch.equal(packed(x_AD, counts_E=counts, offsets_E=None), expected_AD), counts


@needs_bf16_packing
@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_bf16_decoding_on_packed_weights_matches_the_plain_model_bitwise(tie_embeddings):
    model = _model(tie_embeddings=tie_embeddings)
    engine, packed = _generate(model)  # 'auto' packs bf16
    assert engine.decoding.twin == "packed"
    _, plain = _generate(model, packed_linear="off")
    assert [s.tokens for s in packed] == [s.tokens for s in plain]
    assert [s.logprobs for s in packed] == [s.logprobs for s in plain]


@needs_bf16_packing
@pytest.mark.parametrize("size", [qwen3_size, qwen3_moe_size], ids=["qwen3", "qwen3_moe"])
def test_in_place_weight_changes_are_repacked(size):
    model = _model(size=size)
    engine, before = _generate(model)
    with torch.no_grad():  # what an optimizer step on a shared trainer module does
        for parameter in model.parameters():
            parameter.mul_(-1.5)
    engine.update_weights(model, version=1)  # whoever writes the weights says so
    requests = [
        SampleRequest(prompt=p, params=SamplingParams(max_tokens=10, seed=i, temperature=0.8))
        for i, p in enumerate(PROMPTS)
    ]
    after = [r.sequences[0] for r in engine.generate(requests)]
    _, expected = _generate(model, packed_linear="off")
    assert [s.tokens for s in after] == [s.tokens for s in expected]
    assert [s.logprobs for s in after] == [s.logprobs for s in expected]
    assert [s.tokens for s in after] != [s.tokens for s in before]


@needs_bf16_packing
def test_state_dict_updates_are_repacked():
    engine, _ = _generate(_model())
    other = _model(seed=9)
    engine.update_weights(other.state_dict(), version=2)
    requests = [SampleRequest(prompt=PROMPTS[2], params=SamplingParams(max_tokens=10, seed=1))]
    (response,) = engine.generate(requests)
    plain = _engine(other, packed_linear="off")
    (reference,) = plain.generate(requests)
    assert response.sequences[0].tokens == reference.sequences[0].tokens
    assert response.sequences[0].logprobs == reference.sequences[0].logprobs


@pytest.mark.parametrize("size", [qwen3_size, qwen3_moe_size], ids=["qwen3", "qwen3_moe"])
def test_fp32_is_not_packed_unless_asked(size):
    model = _model(dtype="float32", size=size)
    engine, _ = _generate(model)
    assert engine.decoding.twin != "packed"
    engine, packed = _generate(model, packed_linear="on")
    assert engine.decoding.twin == "packed"
    _, plain = _generate(model, packed_linear="off")
    for a, b in zip(packed, plain, strict=True):  # fp32 oneDNN sums in another order
        assert a.tokens == b.tokens
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )


def test_bad_packing_mode_is_named():
    with pytest.raises(ValueError, match=r"cpu\.packed_linear must be 'auto', 'on' or 'off'"):
        CpuDecoding.Config(packed_linear="always")
