"""The hybrid decode twin: bitwise the model's own decode (tiny Qwen3.5 and Qwen3.5-MoE in
fp32, and in bf16 on packed weights), writing the same recurrent states into the pool, rebuilt
after updates, and not used where it cannot stand in for the model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize
from temper.models.lora import LoraConfig, apply_lora
from temper.models.qwen3_5 import qwen3_5_size
from temper.models.qwen3_5_moe import qwen3_5_moe_size
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.cpu.hybrid_twin import FusedHybridDecoder, hybrid_fusable
from temper.sampler.cpu.packed_linear import PackedDecoder, packing_available
from temper.sampler.engine import SamplerEngine, SampleRequest

VOCAB = 37
SIZES = {"qwen3_5": qwen3_5_size, "qwen3_5_moe": qwen3_5_moe_size}

_REQUESTS = [
    SampleRequest(prompt=[1, 2, 3], params=SamplingParams(max_tokens=9, seed=4), num_samples=5),
    SampleRequest(prompt=[7, 8], params=SamplingParams(max_tokens=6, temperature=0)),
    SampleRequest(prompt=[5] * 11, params=SamplingParams(max_tokens=12, top_k=5, seed=1)),
]


def _model(family="qwen3_5", *, seed=3, dtype="float32"):
    config = dataclasses.replace(SIZES[family]("tiny", vocab_size=VOCAB), init_std=0.1)
    return materialize(config, seed=seed, dtype=dtype).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


def _engine(model, *, max_batch=16, **cpu):
    config = SamplerEngine.Config(
        max_batch=max_batch,
        max_seq_len=64,
        cpu=CpuDecoding.Config(**{"processes": 1, **cpu}),
    )
    return config.build(model=model)


def _decoder(engine):
    return engine.decoding.decoder(engine.weights)


def _assert_bitwise(responses, expected):
    for a, b in zip(responses, expected, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.logprobs for s in a.sequences] == [s.logprobs for s in b.sequences]


@pytest.mark.parametrize("family", list(SIZES))
def test_fused_hybrid_decode_is_bitwise_the_models_own(family, model):
    model = model if family == "qwen3_5" else _model(family)
    fused_engine = _engine(model)
    assert isinstance(_decoder(fused_engine), FusedHybridDecoder)
    plain_engine = _engine(model, fused_projections=False)
    assert _decoder(plain_engine) is model
    _assert_bitwise(fused_engine.generate(_REQUESTS), plain_engine.generate(_REQUESTS))


@pytest.mark.parametrize("num_rows", [1, 5, 64])
def test_one_step_writes_the_models_states_and_logits(model, num_rows, monkeypatch):
    """One decode step from the same pool contents: the same logits and the same conv and
    recurrent states written, bitwise, at several row counts (vectorized and scalar tails)."""
    results = []
    for fused in (True, False):
        if fused:  # the twin's own step, not the model's forward behind it
            monkeypatch.setattr(model, "hidden_states", _not_called)
        else:
            monkeypatch.undo()
        engine = _engine(model, max_batch=num_rows, fused_projections=fused)
        pool = engine.cache.states
        generator = torch.Generator().manual_seed(num_rows)
        pool.conv_LSCW.copy_(torch.randn(pool.conv_LSCW.shape, generator=generator))
        pool.state_LSNKV.copy_(torch.randn(pool.state_LSNKV.shape, generator=generator))
        tokens_B = torch.randint(0, VOCAB, (num_rows,), generator=generator)
        positions_B = torch.randint(0, 8, (num_rows,), generator=generator)
        with torch.inference_mode():
            logits_BV = engine.decoding.logits(
                _decoder(engine),
                engine.cache,
                tokens_B=tokens_B,
                positions_B=positions_B,
                width=8,
                first_slot=0,
            )
        results.append((logits_BV, pool.conv_LSCW.clone(), pool.state_LSNKV.clone()))
    for fused, plain in zip(*results, strict=True):
        assert torch.equal(fused, plain)


def _not_called(*args, **kwargs):
    raise AssertionError("the twin ran the model's own forward")


def test_an_in_place_update_rebuilds_the_fused_weights(model):
    model = _model(seed=4)
    engine = _engine(model)
    first = _decoder(engine)
    assert _decoder(engine) is first  # unchanged weights: reused
    mixer = model.blocks[0].linear_attention
    with torch.no_grad():
        mixer.in_proj_b.weight.mul_(1.5)
    engine.update_weights(model, version=1)
    second = _decoder(engine)
    assert second is not first
    x_BD = torch.randn(4, 128)
    assert torch.equal(second._layers[0].gates_proj(x_BD)[:, :4], mixer.in_proj_b(x_BD))


def test_only_plain_hybrid_models_are_fused(model):
    assert hybrid_fusable(model)
    assert hybrid_fusable(_model().to(torch.bfloat16))
    assert not hybrid_fusable(_model().half())
    lora_model = _model()
    apply_lora(lora_model, LoraConfig(rank=4))
    assert not hybrid_fusable(lora_model)
    assert _decoder(_engine(lora_model, max_batch=4)) is lora_model
    bf16 = _model().to(torch.bfloat16)  # unpacked bf16: its own forward
    engine = _engine(bf16, max_batch=4, packed_linear="off")
    assert engine.decoding.twin == "none" and _decoder(engine) is bf16


@pytest.mark.skipif(
    not packing_available(torch.bfloat16), reason="oneDNN cannot pack bf16 on this CPU"
)
@pytest.mark.parametrize("family", list(SIZES))
def test_packed_bf16_fused_hybrid_decode_is_bitwise_the_models_own(family):
    model = _model(family, seed=5, dtype="bfloat16")
    fused_engine = _engine(model)  # 'auto' packs bf16
    decoder = _decoder(fused_engine)
    assert isinstance(decoder, FusedHybridDecoder) and decoder._output is not None
    plain = _engine(model, packed_linear="off").generate(_REQUESTS)
    _assert_bitwise(fused_engine.generate(_REQUESTS), plain)
    unfused_engine = _engine(model, fused_projections=False)
    assert isinstance(_decoder(unfused_engine), PackedDecoder)
    _assert_bitwise(unfused_engine.generate(_REQUESTS), plain)
