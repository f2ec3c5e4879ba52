"""Qwen3.5 (Gated DeltaNet layer 0, gated full attention layer 1) under the decoder plan on 2
gloo ranks: FSDP2, TP (heads of both mixers split, hybrid_parallel.py), activation
checkpointing and LoRA on every projection (the linear-attention ones included) under FSDP
train like one process on all the data; a DCP checkpoint saved under TP loads under FSDP and in
one process bitwise, and the resumed FSDP run continues bitwise. Qwen3.5-MoE (4 routed experts
and a shared expert a layer): expert parallelism (2 experts a rank), EP with LoRA on the
experts, and TP (experts whole on each rank) likewise. FSDP x TP on 4 ranks too.

One spawn runs every 2-rank scenario (process start-up dominates on a small machine).
"""

from __future__ import annotations

import copy

import pytest
from torch.distributed.tensor import DTensor

from temper.checkpoint.dcp import load_train_state, save_train_state
from temper.checkpoint.gather import full_state_dict
from temper.distributed.local_shard import local_part
from temper.distributed.parallel_dims import ParallelDims
from temper.trainer import LoraConfig
from tests.distributed import training
from tests.distributed.spawn import spawn
from tests.distributed.test_checkpoint_and_gather import _assert_equal, _full_state, _train_steps
from tests.distributed.test_sharded_training import ALTERNATE, _assert_matches

FAMILY = "qwen3_5"
LORA = LoraConfig(rank=4, alpha=8.0)
METADATA = {"policy_version": 2}
SCENARIOS = {
    "fsdp": ({"dims": {"dp_shard": 2}}, ALTERNATE),
    "tp": ({"dims": {"dp_shard": 1, "tp": 2}}, None),
    "fsdp_checkpointing": (
        {"dims": {"dp_shard": 2}, "activation_checkpointing": "full"},
        ALTERNATE,
    ),
    "fsdp_lora": ({"dims": {"dp_shard": 2}, "lora": LORA}, ALTERNATE),
    "moe_ep": ({"dims": {"dp_shard": 2, "ep": 2}, "family": "qwen3_5_moe"}, ALTERNATE),
    "moe_ep_lora": (
        {"dims": {"dp_shard": 2, "ep": 2}, "family": "qwen3_5_moe", "lora": LORA},
        ALTERNATE,
    ),
    "moe_tp": ({"dims": {"dp_shard": 1, "tp": 2}, "family": "qwen3_5_moe"}, None),
}


def _engine(dims: dict | None = None, *, family: str = FAMILY, **kwargs):
    dims = None if dims is None else ParallelDims.Config(**dims)
    return training.engine(family=family, dims=dims, **kwargs)


def _tp_shapes(engine) -> dict[str, tuple[bool, tuple[int, ...]]]:
    """(is a DTensor, local shape) of the mixers' weights on this rank."""
    linear = engine.model.blocks[0].linear_attention
    attention = engine.model.blocks[1].attention
    weights = {
        "in_proj_qkv": linear.in_proj_qkv.weight,
        "in_proj_z": linear.in_proj_z.weight,
        "in_proj_b": linear.in_proj_b.weight,
        "A_log": linear._parameters["A_log"],
        "conv_weight": linear._parameters["conv_weight"],
        "out_proj": linear.out_proj.weight,
        "wq": attention.wq.weight,
        "wo": attention.wo.weight,
    }
    return {
        name: (isinstance(weight, DTensor), tuple(local_part(weight).shape))
        for name, weight in weights.items()
    }


def _checkpoints(rank: int, directory) -> dict:
    """Train 2 steps under TP and save; load under FSDP (bitwise), one more step on each."""
    results = {}
    engine = _engine({"dp_shard": 1, "tp": 2})
    _train_steps(engine)
    save_train_state(
        directory / "tp",
        model=engine.model,
        optimizer=engine.optimizer.torch_optimizer,
        metadata=METADATA,
        trainable_only=False,
    )
    results["saved"] = _full_state(engine)
    del engine
    fsdp = _engine({"dp_shard": 2})
    load_train_state(
        directory / "tp",
        model=fsdp.model,
        optimizer=fsdp.optimizer.torch_optimizer,
        trainable_only=False,
    )
    results["tp_to_fsdp"] = copy.deepcopy(_full_state(fsdp))  # the step counts move on below
    save_train_state(
        directory / "fsdp",
        model=fsdp.model,
        optimizer=fsdp.optimizer.torch_optimizer,
        metadata=METADATA,
        trainable_only=False,
    )
    _train_steps(fsdp, steps=1)
    results["continued"] = full_state_dict(fsdp.model)
    del fsdp
    resumed = _engine({"dp_shard": 2})
    load_train_state(
        directory / "fsdp",
        model=resumed.model,
        optimizer=resumed.optimizer.torch_optimizer,
        trainable_only=False,
    )
    _train_steps(resumed, steps=1)
    results["resumed"] = full_state_dict(resumed.model)
    del resumed
    return results


def _run_scenarios(rank: int, directory) -> dict:
    results = {}
    for name, (kwargs, shares) in SCENARIOS.items():
        engine = _engine(**kwargs)
        share = slice(None) if shares is None else shares[engine.sharding.dp_rank]
        if name == "tp":
            results["tp_shapes"] = _tp_shapes(engine)
        if name == "moe_ep":
            experts = engine.model.blocks[0].feed_forward.experts
            results["ep_experts"] = tuple(local_part(experts.w_gate).shape)
        results[name] = training.train(engine, share=share)
        del engine
    results["checkpoints"] = _checkpoints(rank, directory)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[list[dict], object]:
    directory = tmp_path_factory.mktemp("checkpoints")
    ranks = spawn(
        _run_scenarios,
        world_size=2,
        out_dir=tmp_path_factory.mktemp("ranks"),
        args=(directory,),
    )
    return ranks, directory


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_train_qwen3_5_like_one_process(results, scenario):
    kwargs, _ = SCENARIOS[scenario]
    reference = training.train(
        _engine(family=kwargs.get("family", FAMILY), lora=kwargs.get("lora"))
    )
    for result in results[0]:
        _assert_matches(result[scenario], reference)


def test_expert_parallelism_holds_half_of_the_experts_on_each_rank(results):
    config = training.tiny_model(family="qwen3_5_moe").config
    for result in results[0]:
        assert result["ep_experts"] == (2, config.moe_ffn_dim, config.dim)


def test_tp_splits_the_heads_of_both_mixers(results):
    config = training.tiny_model(family=FAMILY).config
    D = config.dim
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    heads = config.linear_num_value_heads
    attention_width = config.num_heads * config.head_dim
    for result in results[0]:
        shapes = result["tp_shapes"]
        assert shapes["in_proj_z"] == (True, (value_dim // 2, D))
        assert shapes["in_proj_b"] == (True, (heads // 2, D))
        assert shapes["A_log"] == (True, (heads // 2,))
        assert shapes["out_proj"] == (True, (D, value_dim // 2))
        # q, k and v side by side: whole on each rank, each rank multiplying its heads' rows.
        assert shapes["in_proj_qkv"] == (True, (2 * key_dim + value_dim, D))
        assert shapes["conv_weight"][1][0] == 2 * key_dim + value_dim
        # The gated attention's q with its gate, per head: half of the heads each.
        assert shapes["wq"] == (True, (attention_width, D))
        assert shapes["wo"] == (True, (D, attention_width // 2))


def test_a_tp_checkpoint_loads_under_fsdp_and_in_one_process_and_resumes_bitwise(results):
    ranks, directory = results
    for rank in ranks:
        checkpoints = rank["checkpoints"]
        _assert_equal(checkpoints["tp_to_fsdp"], checkpoints["saved"], "tp -> fsdp")
        _assert_equal(checkpoints["resumed"], checkpoints["continued"], "resumed")
    single = _engine()
    metadata = load_train_state(
        directory / "tp",
        model=single.model,
        optimizer=single.optimizer.torch_optimizer,
        trainable_only=False,
    )
    assert metadata == METADATA
    _assert_equal(_full_state(single), ranks[0]["checkpoints"]["saved"], "tp -> one process")


def _train_fsdp_times_tp(rank: int) -> dict:
    engine = _engine({"dp_shard": 2, "tp": 2})
    return training.train(engine, share=slice(engine.sharding.dp_rank, None, 2))


def test_fsdp_times_tp_on_four_ranks_trains_qwen3_5_like_one_process(tmp_path):
    results = spawn(_train_fsdp_times_tp, world_size=4, out_dir=tmp_path)
    reference = training.train(_engine())
    for result in results:
        _assert_matches(result, reference)


def test_tp_must_divide_the_linear_attention_heads():
    config = training.tiny_model(family=FAMILY, num_kv_heads=4).config  # 2 linear key heads
    dims = ParallelDims(ParallelDims.Config(dp_shard=1, tp=4), world_size=4)
    with pytest.raises(ValueError, match=r"tp=4 must divide the model's linear_num_key_heads"):
        dims.check_model(config)
