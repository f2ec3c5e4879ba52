"""Routing replay in the trainer: a Qwen3-MoE policy sampled in bf16 (the packed decode twin,
routes recorded) and trained in fp32 picks other experts for some tokens; with
routing_replay='sampler' its top-k is the sampler's for every token (routing/topk_diff 0), with
every loss and the custom loss, however a call is split (micro-batches, thread shards, shared
prefixes, also where the samples' prompt routes differ), with activation checkpointing and with
LoRA on the experts. Each datum's replayed logprobs are those of a one-datum forward whose
blocks are handed its routes directly; replaying the trainer's own routes changes nothing,
bitwise. Bad input is refused before any work, naming the field."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from torch.distributed._composable import checkpoint as checkpoint_module

from temper.api import Datum, ModelInput, RoutedExperts, SamplingParams
from temper.losses import LOSSES
from temper.models import materialize, qwen3_moe_size, qwen3_size
from temper.models.common.logprobs import forward_logprobs
from temper.models.common.moe import ReplayedRoutes
from temper.models.common.moe_stats import moe_layers
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.trainer import LoraConfig, TrainerEngine
from tests.sampler.test_routes import full_forward_routes

VOCAB = 31
PROMPTS = [[3, 4, 5, 6, 7, 8], [9, 1, 2, 2, 3, 1, 4]]


def _model():
    # init_std 0.1: confident routers and logits; layer 1 dense (its routes skip it).
    config = dataclasses.replace(
        qwen3_moe_size("tiny", vocab_size=VOCAB), init_std=0.1, mlp_only_layers=(1,)
    )
    return materialize(config, seed=5, dtype="float32")


@pytest.fixture(scope="module")
def samples():
    """GRPO-like groups sampled from a bf16 copy of the model, routes recorded."""
    sampler_model = copy.deepcopy(_model()).to(torch.bfloat16).eval()
    engine = SamplerEngine.Config(
        max_batch=16, max_seq_len=64, record_routes=True, cpu=CpuDecoding.Config(processes=1)
    ).build(model=sampler_model)
    requests = [
        SampleRequest(prompt=prompt, params=SamplingParams(max_tokens=14, seed=seed), num_samples=4)
        for seed, prompt in enumerate(PROMPTS)
    ]
    responses = engine.generate(requests)
    return [
        (request.prompt, sequence)
        for request, response in zip(requests, responses, strict=True)
        for sequence in response.sequences
    ]


def _data(samples, *, routes: bool = True) -> list[Datum]:
    """Policy datums of the samples, with inputs for every built-in loss."""
    data = []
    for prompt, sequence in samples:
        tokens = [*prompt, *sequence.tokens]
        num_prompt = len(prompt) - 1
        data.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [0.0] * num_prompt + sequence.logprobs,
                    "advantages": [0.0] * num_prompt + [0.1] * len(sequence.tokens),
                    "weights": [0.0] * num_prompt + [0.1] * len(sequence.tokens),
                },
                routed_experts=sequence.routed_experts if routes else None,
            )
        )
    return data


def _engine(model=None, **config) -> TrainerEngine:
    return TrainerEngine.Config(**config).build(model=model or _model(), lora=None)


def _logprobs(output) -> list[torch.Tensor]:
    return [record["logprobs"].to_torch() for record in output.loss_fn_outputs]


def _grads(engine) -> list[torch.Tensor]:
    return [p.grad.clone() for p in engine.trainable]


def test_replay_makes_every_tokens_topk_the_samplers(samples):
    data = _data(samples)
    engine = _engine()
    off = engine.forward_backward(data, "importance_sampling").metrics
    engine.zero_grad()
    on = engine.forward_backward(data, "importance_sampling", routing_replay="sampler").metrics
    # bf16 decoding and the fp32 trainer disagree on some tokens' experts...
    assert off["routing/topk_diff:mean"] > 0.02 and off["routing/topk_diff_layers:mean"] > 0
    assert off["routing/router_topk_diff:mean"] == off["routing/topk_diff:mean"]
    # ...and not under replay; the trainer's own router still would, and is reported.
    assert on["routing/topk_diff:mean"] == 0 and on["routing/topk_diff_layers:mean"] == 0
    assert on["routing/router_topk_diff:mean"] > 0


def _replayed_alone(model, datum: Datum) -> torch.Tensor:
    """A datum's target logprobs from a forward of it alone, its routes handed to the blocks
    directly (every token given)."""
    tokens = datum.model_input.to_ints()
    routes_TLK = datum.routed_experts.to_torch()
    blocks = [block for _, block in moe_layers(model)]
    thread = threading.get_ident()
    for layer, block in enumerate(blocks):
        block.replays[thread] = ReplayedRoutes(
            experts_NK=routes_TLK[:, layer], given_N1=torch.ones(len(tokens), 1, dtype=torch.bool)
        )
    try:
        with torch.no_grad():
            targets = datum.loss_fn_inputs["target_tokens"].to_torch()
            return forward_logprobs(model, torch.tensor([tokens]), targets[None])[0]
    finally:
        for block in blocks:
            block.replays.clear()


SPLITS = {
    "one-padded-batch": {"share_prefixes": False},
    "shared-prefixes": {"share_prefixes": True},
    "micro-batches": {"max_tokens_per_microbatch": 48, "share_prefixes": False},
    "thread-shards": {"shard_threads": 2},
}


@pytest.mark.parametrize("split", list(SPLITS))
def test_each_datum_is_replayed_as_alone_however_the_call_is_split(samples, split):
    data = _data(samples)
    engine = _engine(**SPLITS[split])
    output = engine.forward_backward(data, "importance_sampling", routing_replay="sampler")
    assert output.metrics["routing/topk_diff:mean"] == 0
    for datum, logprobs in zip(data, _logprobs(output), strict=True):
        expected = _replayed_alone(engine.model, datum)
        torch.testing.assert_close(logprobs, expected, rtol=0, atol=2e-5)


def test_a_shared_prompt_runs_once_only_where_its_samples_routes_agree(samples):
    """Samples of one prompt share its prefill's routes; one whose prompt routes differ at a
    position (another prefill, another batch) gets its own from there: the packed prefix is
    cut where routes part, and every datum still gets its own."""
    data = _data(samples)
    routes_TLK = data[1].routed_experts.to_torch()
    routes_TLK[3, 0] = torch.tensor([e for e in range(8) if e not in routes_TLK[3, 0]][:2])
    data[1] = dataclasses.replace(
        data[1], routed_experts=RoutedExperts.from_torch(routes_TLK, num_experts=8)
    )
    engine = _engine(share_prefixes=True)
    output = engine.forward_backward(data, "importance_sampling", routing_replay="sampler")
    assert output.metrics["routing/topk_diff:mean"] == 0
    for datum, logprobs in zip(data, _logprobs(output), strict=True):
        torch.testing.assert_close(
            logprobs, _replayed_alone(engine.model, datum), rtol=0, atol=2e-5
        )


def test_replaying_the_trainers_own_routes_changes_nothing(samples):
    model = _model()
    own = []
    for datum in _data(samples, routes=False):
        routes_TLK = full_forward_routes(model, datum.model_input.to_ints())
        own.append(
            dataclasses.replace(
                datum, routed_experts=RoutedExperts.from_torch(routes_TLK, num_experts=8)
            )
        )
    engine = _engine(model, share_prefixes=False)
    off = engine.forward_backward(own, "ppo")
    off_grads = _grads(engine)
    engine.zero_grad()
    on = engine.forward_backward(own, "ppo", routing_replay="sampler")
    assert off.metrics["routing/topk_diff:mean"] == 0
    assert off.metrics["loss:sum"] == on.metrics["loss:sum"]
    for a, b in zip(_logprobs(off), _logprobs(on), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(off_grads, _grads(engine), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("loss_fn", [*LOSSES, "custom"])
def test_replay_with_every_loss(samples, loss_fn):
    data = _data(samples)
    engine = _engine()
    forward = engine.forward(data, "cross_entropy", routing_replay="sampler")
    if loss_fn == "custom":

        def loss(data, logprobs):
            total = sum((lp * 0.1).sum() for lp in logprobs)
            return total, {}

        output = engine.forward_backward_custom(data, loss, routing_replay="sampler")
    else:
        config = {"beta": 0.1} if LOSSES[loss_fn].required_config else None
        output = engine.forward_backward(data, loss_fn, config, routing_replay="sampler")
    assert output.metrics["routing/topk_diff:mean"] == 0
    # The loss's forward is the replayed one: its logprobs are `forward`'s with replay.
    for a, b in zip(_logprobs(forward), _logprobs(output), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    off = engine.forward(data, "cross_entropy")
    moved = [not torch.equal(a, b) for a, b in zip(_logprobs(off), _logprobs(forward), strict=True)]
    assert any(moved)  # replay changed some datums' logprobs
    routers = [block.router.weight.grad for _, block in moe_layers(engine.model)]
    assert all(grad is not None and grad.abs().sum() > 0 for grad in routers)
    assert all(torch.isfinite(p.grad).all() for p in engine.trainable if p.grad is not None)


def test_activation_checkpointing_recomputes_the_replayed_routes(samples):
    """A checkpointed block's forward runs again in backward: it replays the same routes,
    also when autograd runs the backward on another thread (as on CUDA)."""
    data = _data(samples)[:4]
    plain = _engine(share_prefixes=False)
    plain.forward_backward(data, "importance_sampling", routing_replay="sampler")
    expected = _grads(plain)

    model = _model()
    for block in model.blocks:
        checkpoint_module(block)
    checkpointed = _engine(model, share_prefixes=False)
    checkpointed.forward_backward(data, "importance_sampling", routing_replay="sampler")
    for a, b in zip(expected, _grads(checkpointed), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    checkpointed.zero_grad()
    spec = LOSSES["importance_sampling"]
    prepared = checkpointed._prepare(data, required=spec.required_inputs, replay="sampler")
    (batch,) = checkpointed._batches(prepared, replay="sampler")
    with checkpointed._replaying(batch, "sampler"):
        loss = checkpointed._batch_loss(batch, spec, {}, [None] * len(data))
    # The backward (and with it the recomputation) on a thread without a replay of its own.
    worker = threading.Thread(target=loss.backward)
    with checkpointed._replaying(batch, "sampler"):
        worker.start()
        worker.join()
    for a, b in zip(expected, _grads(checkpointed), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_lora_on_the_experts_replays_too(samples):
    data = _data(samples)
    engine = TrainerEngine.Config().build(
        model=_model(), lora=LoraConfig(rank=4, train_mlp=True, train_attn=True)
    )
    off = engine.forward_backward(data, "importance_sampling").metrics
    on = engine.forward_backward(data, "importance_sampling", routing_replay="sampler").metrics
    assert off["routing/topk_diff:mean"] > 0 and on["routing/topk_diff:mean"] == 0


def _with_routes(datum: Datum, routes_TLK: torch.Tensor, *, num_experts: int = 8) -> Datum:
    return dataclasses.replace(
        datum, routed_experts=RoutedExperts.from_torch(routes_TLK, num_experts=num_experts)
    )


def _set(routes_TLK: torch.Tensor, where: tuple[int, int, int], expert: int) -> torch.Tensor:
    changed = routes_TLK.clone()
    changed[where] = expert
    return changed


def test_bad_routes_are_refused_before_any_work(samples):
    data = _data(samples)
    engine = _engine()
    engine.forward_backward(data[:2], "importance_sampling")
    before = _grads(engine)
    routes_TLK = data[3].routed_experts.to_torch()
    bad = {
        "missing": (dataclasses.replace(data[3], routed_experts=None), "datum 3: routed_experts "
                    "is missing; routing_replay='sampler' replays"),
        "short": (_with_routes(data[3], routes_TLK[:-1]), r"datum 3: routed_experts has shape "
                  r"\[\d+, 3, 2\], but the datum has \d+ tokens"),
        "layers": (_with_routes(data[3], routes_TLK[:, :2]), "the model 3 MoE layers of top_k 2"),
        "expert": (_with_routes(data[3], _set(routes_TLK, (1, 2, 0), 9), num_experts=16),
                   "token 1, MoE layer 2 names expert 9; valid ids are 0..7"),
        "twice": (_with_routes(data[3], routes_TLK[..., :1].expand(-1, -1, 2)),
                  "names an expert twice"),
    }  # fmt: skip
    for name, (datum, message) in bad.items():
        call = [*data[:3], datum, *data[4:]]
        with pytest.raises(ValueError, match=message):
            engine.forward_backward(call, "importance_sampling", routing_replay="sampler")
        assert all(torch.equal(a, b) for a, b in zip(before, _grads(engine), strict=True)), name
    with pytest.raises(ValueError, match="routing_replay must be 'off' or 'sampler', got 'on'"):
        engine.forward_backward(data, "importance_sampling", routing_replay="on")
    # Without replay, datums without routes are fine; malformed ones are still refused.
    engine.forward_backward([*data[:3], dataclasses.replace(data[3], routed_experts=None)], "ppo")
    with pytest.raises(ValueError, match="datum 0: routed_experts has shape"):
        engine.forward([_with_routes(data[0], data[0].routed_experts.to_torch()[:-1])], "ppo")


def test_replay_on_a_dense_model_is_refused_naming_the_field(samples):
    dense = TrainerEngine.Config().build(
        model=materialize(qwen3_size("tiny", vocab_size=VOCAB), seed=1), lora=None
    )
    plain = _data(samples, routes=False)[:2]
    with pytest.raises(ValueError, match="routing_replay='sampler' replays a MoE model's routes"):
        dense.forward_backward(plain, "ppo", routing_replay="sampler")
    with pytest.raises(ValueError, match="datum 0: routed_experts given, but the model has no MoE"):
        dense.forward_backward(_data(samples)[:2], "ppo")
