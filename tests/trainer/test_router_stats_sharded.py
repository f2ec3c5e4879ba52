"""Router metrics and the load-balancing loss of a MoE trainer sharded over 2 gloo ranks (FSDP):
every rank reports the metrics of all ranks' data, equal to one process's; with an idle rank
too; and 'add' weighs each rank's load-balancing loss by its share of all ranks' tokens, with
activation checkpointing too."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import DTensor

from temper.api import Datum, ModelInput
from temper.distributed.parallel_dims import ParallelDims
from temper.models import materialize, qwen3_moe_size
from temper.models.common.moe_stats import moe_layers
from temper.trainer import TrainerEngine
from temper.trainer.sharding import Sharding
from tests.distributed.spawn import spawn

VOCAB = 31
SHARES = {
    "alternate": (slice(0, None, 2), slice(1, None, 2)),
    "idle_rank": (slice(None), slice(0, 0)),
}


def _engine(*, mode: str = "report", sharded: bool, checkpointing: str = "none") -> TrainerEngine:
    # A coefficient large enough that the load-balancing gradient is not lost in rounding.
    config = dataclasses.replace(
        qwen3_moe_size("tiny", vocab_size=VOCAB), num_layers=2, router_aux_loss_coef=0.5
    )
    dims = ParallelDims.Config(dp_shard=2)
    sharding = (
        Sharding.Config(dims=dims, activation_checkpointing=checkpointing) if sharded else None
    )
    engine_config = TrainerEngine.Config(sharding=sharding, router_aux_loss=mode)
    return engine_config.build(model=materialize(config, seed=0), lora=None)


def _data() -> list[Datum]:
    generator = torch.Generator().manual_seed(5)
    data = []
    for index in range(8):
        tokens = torch.randint(0, VOCAB, (4 + (index * 5) % 11,), generator=generator).tolist()
        data.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:]},
            )
        )
    return data


def _run(rank: int) -> dict:
    results = {}
    for name, shares in SHARES.items():
        engine = _engine(sharded=True)
        data = _data()[shares[engine.sharding.dp_rank]]
        results[name] = engine.forward_backward(data, "cross_entropy").metrics
        del engine
    # Both ranks train on all the data: their load-balancing losses each weigh a half.
    for checkpointing in ("none", "full"):  # "full": the backward recomputes each block
        engine = _engine(mode="add", sharded=True, checkpointing=checkpointing)
        engine.forward_backward(_data(), "cross_entropy")
        results[f"add_grads_{checkpointing}"] = _grads(engine)
        assert all(not block.routings for _, block in moe_layers(engine.model))
        del engine
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(_run, world_size=2, out_dir=tmp_path_factory.mktemp("ranks"))


@pytest.mark.parametrize("shares", list(SHARES))
def test_every_rank_reports_the_router_metrics_of_all_the_data(results, shares):
    reference = _engine(sharded=False).forward_backward(_data(), "cross_entropy").metrics
    assert any(key.startswith("moe/layer_1/") for key in reference)
    for result in results:
        assert result[shares].keys() == reference.keys()
        for key, value in reference.items():
            assert result[shares][key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_add_mode_weighs_each_ranks_aux_loss_by_its_share_of_all_tokens(results, checkpointing):
    # One process on the data twice over, in one micro-batch: twice the loss's gradient, and
    # the load-balancing loss of the same routing shares (counted once).
    engine = _engine(mode="add", sharded=False)
    engine.forward_backward(_data() + _data(), "cross_entropy")
    reference = _grads(engine)
    plain = _engine(sharded=False)
    plain.forward_backward(_data() + _data(), "cross_entropy")
    router = "blocks.0.feed_forward.router.weight"
    assert not torch.allclose(_grads(plain)[router], reference[router], rtol=0.05)
    for result in results:
        grads = result[f"add_grads_{checkpointing}"]
        assert grads.keys() == reference.keys()
        for name, grad in reference.items():
            scale = grad.abs().max().item()
            assert (grads[name] - grad).abs().max().item() <= 1e-5 * scale, name


def _grads(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (gathered from the ranks' shards)."""
    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for name, p in engine.model.named_parameters()
    }
