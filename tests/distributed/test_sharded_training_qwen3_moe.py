"""Qwen3-MoE under the shared decoder plan: FSDP2 (stacked experts sharded on dim 0, 5 experts
split 3 and 2), TP (attention and the dense layer split, routed experts whole on every tp
rank), activation checkpointing (the recomputed forward routes the same way) and LoRA under
FSDP on 2 gloo ranks train like one process on all the data; FSDP x TP on 4 ranks too. TP
checks the dense feed-forward width only where a layer is dense.

The model is the tiny size with 2 layers: layer 0 dense, layer 1 sparse (training.py).
"""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.tensor import DTensor

from temper.distributed.local_shard import local_part
from temper.distributed.parallel_dims import ParallelDims
from temper.models import qwen3_moe_size, qwen3_size
from temper.trainer import LoraConfig
from tests.distributed import training
from tests.distributed.spawn import spawn
from tests.distributed.test_sharded_training import ALTERNATE, UNEVEN, _assert_matches

FAMILY = "qwen3_moe"
# Adapters on attention, the dense layer, every routed expert (stacked, sharded on the expert
# dim like the experts) and the unembedding.
LORA = LoraConfig(rank=4, alpha=8.0)
SCENARIOS = {
    "fsdp": ({"dims": {"dp_shard": 2}}, ALTERNATE),
    "tp": ({"dims": {"dp_shard": 1, "tp": 2}}, None),
    "fsdp_checkpointing": (
        {"dims": {"dp_shard": 2}, "activation_checkpointing": "full"},
        ALTERNATE,
    ),
    # Micro-batches of one datum: the ranks run different numbers of them.
    "fsdp_microbatches": ({"dims": {"dp_shard": 2}, "max_tokens": 12}, UNEVEN),
    "fsdp_lora": ({"dims": {"dp_shard": 2}, "lora": LORA}, ALTERNATE),
}


def _run_scenarios(rank: int) -> dict:
    results = {}
    for name, (kwargs, shares) in SCENARIOS.items():
        kwargs = {**kwargs, "dims": ParallelDims.Config(**kwargs["dims"])}
        engine = training.engine(family=FAMILY, **kwargs)
        share = slice(None) if shares is None else shares[engine.sharding.dp_rank]
        results[name] = training.train(engine, share=share)
        if name in ("fsdp", "tp"):
            experts = engine.model.blocks[1].feed_forward.experts
            results[f"{name}_experts"] = [
                (isinstance(weight, DTensor), tuple(local_part(weight).shape))
                for weight in (experts.w_gate, experts.w_up, experts.w_down)
            ]
        del engine
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(_run_scenarios, world_size=2, out_dir=tmp_path_factory.mktemp("ranks"))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_train_qwen3_moe_like_one_process(results, scenario):
    kwargs, _ = SCENARIOS[scenario]
    reference = training.train(training.engine(family=FAMILY, lora=kwargs.get("lora")))
    for result in results:
        _assert_matches(result[scenario], reference)


def test_fsdp_shards_stacked_experts_on_the_expert_dim_and_tp_keeps_them_whole(results):
    config = training.tiny_model(family=FAMILY).config
    dim, hidden = config.dim, config.moe_ffn_dim

    def shapes(experts: int) -> list[tuple[int, ...]]:
        return [(experts, hidden, dim), (experts, hidden, dim), (experts, dim, hidden)]

    # 5 experts over 2 ranks: rank 0 holds 3, rank 1 holds 2 (FSDP2 pads only internally).
    for rank, experts in enumerate((3, 2)):
        assert results[rank]["fsdp_experts"] == [(True, s) for s in shapes(experts)]
        assert results[rank]["tp_experts"] == [(False, s) for s in shapes(5)]


def _train_fsdp_times_tp(rank: int) -> dict:
    engine = training.engine(family=FAMILY, dims=ParallelDims.Config(dp_shard=2, tp=2))
    return training.train(engine, share=slice(engine.sharding.dp_rank, None, 2))


def test_fsdp_times_tp_on_four_ranks_trains_qwen3_moe_like_one_process(tmp_path):
    results = spawn(_train_fsdp_times_tp, world_size=4, out_dir=tmp_path)
    reference = training.train(training.engine(family=FAMILY))
    for result in results:
        _assert_matches(result, reference)


def _tiny(**changes):
    return dataclasses.replace(qwen3_moe_size("tiny", vocab_size=31), **changes)


def test_tp_splits_ffn_dim_only_where_a_layer_is_dense():
    dims = ParallelDims(ParallelDims.Config(dp_shard=1, tp=2), world_size=2)
    # Every layer sparse: ffn_dim is never used, so an odd one does not matter.
    dims.check_model(_tiny(ffn_dim=383))
    with pytest.raises(ValueError, match=r"tp=2 must divide the model's ffn_dim \(383\)"):
        dims.check_model(_tiny(ffn_dim=383, mlp_only_layers=(0,)))
    with pytest.raises(ValueError, match=r"ffn_dim \(383\)"):
        dims.check_model(_tiny(ffn_dim=383, decoder_sparse_step=2))
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\); valid tp degrees divide "):
        dims.check_model(_tiny(num_heads=6, num_kv_heads=3))
    # Routed experts are never split by TP: an odd expert width or count is fine.
    dims.check_model(_tiny(moe_ffn_dim=127, num_experts=3))


def test_dense_families_still_check_ffn_dim():
    dims = ParallelDims(ParallelDims.Config(dp_shard=1, tp=2), world_size=2)
    with pytest.raises(ValueError, match=r"ffn_dim \(383\)"):
        dims.check_model(dataclasses.replace(qwen3_size("tiny"), ffn_dim=383))
