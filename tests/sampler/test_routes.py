"""The engine's route records (record_routes) on a Qwen3-MoE model: every sequence carries the
experts of each token the model ran for it (prompt, then every sampled token but the last),
and they are the routing a full forward of those tokens takes, on every decode path the engine
takes (the model itself, fused and packed twins, decode shards, helper processes), with samples
that wait for a slot, sequences that move between slots, and prompts that extend a cached
sequence (whose earlier routes come from the prefix cache: the ones it was decoded with)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from temper.api import SampleResponse, SamplingParams
from temper.models import materialize, qwen3_moe_size, qwen3_size
from temper.models.common.moe_stats import moe_layers
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.cpu.process_split import ProcessSplitSampler
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.sampler.prefix_cache import BLOCK

VOCAB = 31


def _model(dtype: str = "float32"):
    # Logits of order 2 (init_std 0.1): distributions far from uniform; layer 1 is dense.
    config = dataclasses.replace(
        qwen3_moe_size("tiny", vocab_size=VOCAB), init_std=0.1, mlp_only_layers=(1,)
    )
    return materialize(config, seed=5, dtype=dtype).eval()


def _engine(model, **config):
    fields = {
        "max_batch": 8,
        "max_seq_len": 96,
        "record_routes": True,
        "cpu": CpuDecoding.Config(processes=1),
    }
    return SamplerEngine.Config(**{**fields, **config}).build(model=model)


def full_forward_routes(model, tokens: list[int]) -> torch.Tensor:
    """The experts [T, L, K] each sparse layer picks in a full forward of `tokens`."""
    blocks = [block for _, block in moe_layers(model)]
    for block in blocks:
        block.keep_routing = True
    try:
        with torch.no_grad():
            model.hidden_states(torch.tensor([tokens]))
        return torch.stack([block.routing.experts_NK for block in blocks], dim=1)
    finally:
        for block in blocks:
            block.keep_routing = False
            block.routings.clear()


def _requests() -> list[SampleRequest]:
    """Three prompts, one of them twice (its requests share a prefill), 14 samples in all:
    more than the 8 slots, so samples wait for a slot and sequences of different lengths
    move down as others finish; greedy and seeded sampling."""
    prompt = [3, 4, 5, 6, 7]
    return [
        SampleRequest(prompt=prompt, params=SamplingParams(max_tokens=9, seed=3), num_samples=5),
        SampleRequest(prompt=[8, 1], params=SamplingParams(max_tokens=5, temperature=0)),
        SampleRequest(prompt=prompt, params=SamplingParams(max_tokens=12, seed=4), num_samples=4),
        SampleRequest(
            prompt=[9, 2, 2, 1, 7, 7, 3],
            params=SamplingParams(max_tokens=7, temperature=0.8, top_k=6, seed=5),
            num_samples=4,
        ),
    ]


def _assert_routes_of_full_forwards(model, requests, responses) -> int:
    """Every sequence's routes are a full forward's of its prompt + tokens[:-1], as sets of
    experts per token and layer; returns the tokens checked."""
    checked = 0
    for request, response in zip(requests, responses, strict=True):
        for sequence in response.sequences:
            tokens = [*request.prompt, *sequence.tokens[:-1]]
            routes = sequence.routed_experts
            assert routes is not None and routes.dtype == "uint8"
            assert routes.shape == (len(tokens), 3, 2)  # 3 sparse layers of top-2
            recorded = routes.to_torch().sort(dim=-1).values
            expected = full_forward_routes(model, tokens).sort(dim=-1).values
            assert torch.equal(recorded, expected), (request.prompt, sequence.tokens)
            checked += len(tokens)
    return checked


PATHS = {
    "model": CpuDecoding.Config(processes=1, fused_projections=False),
    "fused": CpuDecoding.Config(processes=1),
    "decode-shards": CpuDecoding.Config(processes=1, decode_shards=2),
    "helper-processes": CpuDecoding.Config(processes=2, process_min_rows=4),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_recorded_routes_are_a_full_forwards_routing(path):
    model = _model()
    engine = _engine(model, cpu=PATHS[path])
    if path == "helper-processes":
        assert isinstance(engine, ProcessSplitSampler)
    requests = _requests()
    responses = engine.generate(requests)
    assert _assert_routes_of_full_forwards(model, requests, responses) > 100
    engine.close()


def test_the_packed_bf16_twin_records_the_models_own_decode_routes():
    """In bf16 a decode step and a full forward round apart, enough to flip near-tied top-k
    choices (what replay is for); the packed twin's decode is bitwise the model's own, so its
    records are too."""
    model = _model("bfloat16")
    packed = _engine(model)
    assert packed.decoding.twin == "packed"
    plain = _engine(model, cpu=CpuDecoding.Config(processes=1, packed_linear="off"))
    assert plain.decoding.twin == "none"
    requests = _requests()
    for ours, theirs in zip(packed.generate(requests), plain.generate(requests), strict=True):
        for a, b in zip(ours.sequences, theirs.sequences, strict=True):
            assert a.tokens == b.tokens and a.routed_experts == b.routed_experts


def test_a_prompt_extending_a_cached_sequence_takes_its_recorded_routes():
    model = _model()
    engine = _engine(model)
    first = engine.sample([3, 4, 5], SamplingParams(max_tokens=20, seed=1)).sequences[0]
    # The next turn of an episode: the whole first sequence, then an observation.
    turn = [3, 4, 5, *first.tokens, 6, 6]
    hits = engine.prefix_cache.num_hits
    second = engine.sample(turn, SamplingParams(max_tokens=6, seed=2)).sequences[0]
    assert engine.prefix_cache.num_hits == hits + 1
    recorded = second.routed_experts.to_torch()
    cached = first.routed_experts.to_torch()
    assert torch.equal(recorded[: len(cached)], cached)
    _assert_routes_of_full_forwards(
        model, [SampleRequest(prompt=turn)], [SampleResponse(sequences=[second])]
    )
    # A prompt sharing only the first BLOCK tokens of a cached one copies those, routes too.
    long_prompt = list(range(1, BLOCK + 5))
    engine.sample(long_prompt, SamplingParams(max_tokens=2, seed=3))
    branch = [*long_prompt[:BLOCK], 9, 9, 9]
    hits = engine.prefix_cache.num_hits
    response = engine.sample(branch, SamplingParams(max_tokens=3, seed=4))
    assert engine.prefix_cache.num_hits == hits + 1
    _assert_routes_of_full_forwards(model, [SampleRequest(prompt=branch)], [response])


def test_no_routes_unless_recorded_and_none_for_a_dense_model():
    model = _model()
    plain = _engine(model, record_routes=False).sample([1, 2], SamplingParams(max_tokens=3))
    assert plain.sequences[0].routed_experts is None
    dense = materialize(qwen3_size("tiny", vocab_size=VOCAB), seed=1, dtype="float32")
    with pytest.warns(UserWarning, match="record_routes is ignored: the model has no MoE"):
        engine = _engine(dense)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sequence = engine.sample([1, 2], SamplingParams(max_tokens=3)).sequences[0]
    assert sequence.routed_experts is None
