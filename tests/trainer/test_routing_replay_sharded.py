"""Routing replay in a MoE trainer sharded over 2 gloo ranks (FSDP): each rank replays its own
datums' routes, and the gradient and the routing metrics (all ranks' data, an idle rank too)
equal one process's on all the data, with activation checkpointing too (each block's backward
recomputes its forward through the same experts), and with the experts split over the two
ranks (expert parallelism: replay fixes the routing before the experts' all-to-all)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import DTensor

from temper.api import Datum, ModelInput, RoutedExperts
from temper.distributed.parallel_dims import ParallelDims
from temper.models import materialize, qwen3_moe_size
from temper.trainer import TrainerEngine
from temper.trainer.sharding import Sharding
from tests.distributed.spawn import spawn

VOCAB = 31
SHARES = {
    "alternate": (slice(0, None, 2), slice(1, None, 2)),
    "idle_rank": (slice(None), slice(0, 0)),
}


def _engine(*, sharded: bool, checkpointing: str = "none", ep: int = 1) -> TrainerEngine:
    config = dataclasses.replace(qwen3_moe_size("tiny", vocab_size=VOCAB), num_layers=2)
    sharding = None
    if sharded:
        dims = ParallelDims.Config(dp_shard=2, ep=ep)
        sharding = Sharding.Config(dims=dims, activation_checkpointing=checkpointing)
    return TrainerEngine.Config(sharding=sharding).build(
        model=materialize(config, seed=0), lora=None
    )


def _data() -> list[Datum]:
    """Eight datums whose routes are random (distinct experts per token): mostly not the
    trainer's own choice, so replay moves every layer."""
    generator = torch.Generator().manual_seed(5)
    data = []
    for index in range(8):
        tokens = torch.randint(0, VOCAB, (4 + (index * 5) % 11,), generator=generator).tolist()
        length = len(tokens) - 1
        routes_TLK = torch.stack(
            [torch.randperm(8, generator=generator)[:2] for _ in range(length * 2)]
        ).view(length, 2, 2)
        data.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:]},
                routed_experts=RoutedExperts.from_torch(routes_TLK, num_experts=8),
            )
        )
    return data


def _run(rank: int) -> dict:
    del rank
    results = {}
    for name, shares in SHARES.items():
        for checkpointing in ("none", "full"):
            engine = _engine(sharded=True, checkpointing=checkpointing)
            data = _data()[shares[engine.sharding.dp_rank]]
            output = engine.forward_backward(data, "cross_entropy", routing_replay="sampler")
            results[f"{name}_{checkpointing}"] = (output.metrics, _grads(engine))
            del engine
    engine = _engine(sharded=True, ep=2)
    data = _data()[SHARES["alternate"][engine.sharding.dp_rank]]
    output = engine.forward_backward(data, "cross_entropy", routing_replay="sampler")
    results["alternate_none_ep2"] = (output.metrics, _grads(engine))
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(_run, world_size=2, out_dir=tmp_path_factory.mktemp("ranks"))


@pytest.mark.parametrize(
    "case",
    [f"{shares}_{mode}" for shares in SHARES for mode in ("none", "full")] + ["alternate_none_ep2"],
)
def test_sharded_replay_equals_one_process(results, case):
    engine = _engine(sharded=False)
    metrics = engine.forward_backward(_data(), "cross_entropy", routing_replay="sampler").metrics
    reference = _grads(engine)
    assert metrics["routing/topk_diff:mean"] == 0 and metrics["routing/router_topk_diff:mean"] > 0
    for result in results:
        rank_metrics, grads = result[case]
        for key, value in metrics.items():
            if key.startswith("routing/"):
                assert rank_metrics[key] == pytest.approx(value, rel=1e-9), key
        assert rank_metrics["loss:sum"] == pytest.approx(metrics["loss:sum"], rel=1e-5)
        for name, grad in reference.items():
            scale = grad.abs().max().item()
            assert (grads[name] - grad).abs().max().item() <= 1e-5 * scale, name


def _grads(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (gathered from the ranks' shards)."""
    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for name, p in engine.model.named_parameters()
    }
