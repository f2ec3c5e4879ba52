"""The fused-projection decode twin: bitwise the model's own decode (fp32, and bf16 on packed
weights; dense and MoE models), rebuilt after updates, and not used where it cannot stand in
for the model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import llama_size, materialize, qwen3_moe_size, qwen3_size
from temper.models.common.moe import MoE
from temper.models.lora import LoraConfig, apply_lora
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.cpu.fused_decoder import FusedDecoder, fusable
from temper.sampler.cpu.packed_linear import (
    PackedDecoder,
    PackedExperts,
    PackedLinear,
    packing_available,
)
from temper.sampler.engine import SamplerEngine, SampleRequest


def _model(seed=3, *, size=qwen3_size, dtype="float32", **fields):
    config = dataclasses.replace(size("tiny", vocab_size=37), init_std=0.1, **fields)
    return materialize(config, seed=seed, dtype=dtype).eval()


SIZES = {
    "qwen3": {"size": qwen3_size},
    # Llama: no q/k norms, and its llama3-scaled RoPE tables.
    "llama": {"size": llama_size},
    # Qwen3-MoE: attention fused, the MoE blocks the model's own; layer 1 a dense SwiGLU.
    "qwen3_moe": {"size": qwen3_moe_size, "mlp_only_layers": (1,)},
}


_REQUESTS = [
    SampleRequest(prompt=[1, 2, 3], params=SamplingParams(max_tokens=9, seed=4), num_samples=5),
    SampleRequest(prompt=[7, 8], params=SamplingParams(max_tokens=6, temperature=0)),
    SampleRequest(prompt=[5] * 11, params=SamplingParams(max_tokens=12, top_k=5, seed=1)),
]


def _engine(model, *, max_batch=16, max_seq_len=64, **cpu):
    config = SamplerEngine.Config(
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        cpu=CpuDecoding.Config(**{"processes": 1, **cpu}),
    )
    return config.build(model=model)


def _decoder(engine):
    """What the engine's decode steps run on now."""
    return engine.decoding.decoder(engine.weights)


def _generate(model, *, fused: bool):
    engine = _engine(model, fused_projections=fused)
    return engine, engine.generate(_REQUESTS)


@pytest.mark.parametrize("family", list(SIZES))
def test_fused_decode_is_bitwise_the_models_own(family):
    model = _model(**SIZES[family])
    fused_engine, fused = _generate(model, fused=True)
    assert fused_engine.decoding.twin == "fused"
    decoder = _decoder(fused_engine)
    assert isinstance(decoder, FusedDecoder)
    for layer, block in zip(decoder._layers, model.blocks, strict=True):
        if isinstance(block.feed_forward, MoE):  # not copied: the model's own block
            assert layer.feed_forward is block.feed_forward
    plain_engine, plain = _generate(model, fused=False)
    assert plain_engine.decoding.twin == "none"
    assert _decoder(plain_engine) is model
    _assert_bitwise(fused, plain)


def test_an_in_place_update_rebuilds_the_fused_weights():
    model = _model()
    engine, _ = _generate(model, fused=True)
    first = _decoder(engine)
    assert _decoder(engine) is first  # unchanged weights: reused
    with torch.no_grad():
        model.blocks[0].attention.wk.weight.mul_(1.5)
    engine.update_weights(model, version=1)  # whoever writes the weights says so
    second = _decoder(engine)
    assert second is not first
    attention = model.blocks[0].attention
    x_BD = torch.randn(3, 128)
    assert torch.equal(second._layers[0].qkv(x_BD)[:, 128:192], attention.wk(x_BD))


def test_only_plain_projections_are_fused():
    assert fusable(_model())
    assert fusable(_model().to(torch.bfloat16))
    assert fusable(_model(size=qwen3_moe_size))
    assert not fusable(_model().half())
    lora_model = _model()
    apply_lora(lora_model, LoraConfig(rank=4))
    assert not fusable(lora_model)
    engine = _engine(lora_model, max_batch=4, max_seq_len=32)
    assert _decoder(engine) is lora_model
    # bf16 is fused only on packed weights (unpacked, it decodes on its own forward).
    bf16 = _model().to(torch.bfloat16)
    engine = _engine(bf16, max_batch=4, packed_linear="off")
    assert engine.decoding.twin == "none" and _decoder(engine) is bf16


@pytest.mark.skipif(
    not packing_available(torch.bfloat16), reason="oneDNN cannot pack bf16 on this CPU"
)
@pytest.mark.parametrize("tie_embeddings", [True, False])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_packed_bf16_fused_decode_is_bitwise_the_models_own(family, tie_embeddings):
    model = _model(seed=5, dtype="bfloat16", tie_embeddings=tie_embeddings, **SIZES[family])
    fused_engine, fused = _generate(model, fused=True)  # 'auto' packs bf16
    decoder = _decoder(fused_engine)
    assert isinstance(decoder, FusedDecoder) and decoder._output is not None
    plain_engine = _engine(model, packed_linear="off")
    assert _decoder(plain_engine) is model
    plain = plain_engine.generate(_REQUESTS)
    _assert_bitwise(fused, plain)
    # Not fused when asked not to: the packed twin of the model's own layers.
    unfused_engine, unfused = _generate(model, fused=False)
    assert isinstance(_decoder(unfused_engine), PackedDecoder)
    _assert_bitwise(unfused, plain)
    if family == "qwen3_moe":  # the experts and routers really are packed, in both twins
        for twin in (decoder._layers[0].feed_forward, _decoder(unfused_engine)._twin.blocks[0]):
            moe = getattr(twin, "feed_forward", twin)
            assert isinstance(moe.experts, PackedExperts)
            assert isinstance(moe.router, PackedLinear)


def _assert_bitwise(responses, expected):
    for a, b in zip(responses, expected, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.logprobs for s in a.sequences] == [s.logprobs for s in b.sequences]
