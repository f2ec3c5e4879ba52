"""The memory plan of a Qwen3-MoE model: total and active parameters, the routed experts'
bytes per rank (sharded over the FSDP degree only), against real tensors in one process and
as FSDP shards on 2 gloo ranks, the activations a sparse layer saves, and the decode graphs'
temporaries."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from temper.distributed.parallel_dims import ParallelDims
from temper.job.memory_plan import ModelShapes, PlanSettings, activation_bytes, plan_memory
from temper.job.memory_report import headline
from temper.job.model_bytes import TrainerBytes, is_expert
from temper.job.runtime_bytes import graph_pool_bytes
from temper.models import QWEN3_MOE_SIZES, materialize, qwen3_moe_size
from temper.models.lora import LoraConfig, apply_lora
from tests.distributed import training
from tests.distributed.spawn import spawn
from tests.job.test_memory_plan import _saved_bytes, _settings, _storage_bytes, _trained_bytes

FAMILY = "qwen3_moe"
A3B = QWEN3_MOE_SIZES["30B-A3B"]


def _rows(plan, role: str = "colocated") -> dict[str, int]:
    """Bytes by item name (the text before the first comma): a MoE model's weights rows
    differ after their colon."""
    return {row.item.split(",")[0]: row.num_bytes for row in plan.role(role).rows}


def _big(**changes) -> PlanSettings:
    """Qwen3-30B-A3B, full fine-tuning under 'bf16-mixed' on 2 x 8 ranks."""
    base = {"model": "Qwen/Qwen3-30B-A3B", "nnodes": 2, "nproc_per_node": 8, "dtype": "bf16-mixed"}
    return PlanSettings(**{**base, "batch": 256, "max_seq_len": 1024, **changes})


@pytest.mark.parametrize("name", ["Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B"])
def test_a_moe_plan_counts_total_and_active_parameters(name):
    plan = plan_memory(_big(model=name))
    config = QWEN3_MOE_SIZES[name.removeprefix("Qwen/Qwen3-")]
    assert plan.num_params == config.num_params
    assert plan.num_active_params == config.num_active_params < config.num_params
    assert headline(plan).startswith(
        f"{name} ({config.num_params / 1e9:.2f}B parameters, "
        f"{config.num_active_params / 1e9:.2f}B active), full, bf16-mixed;"
    )


def test_30b_a3b_is_30_5b_parameters_with_3_3b_active():
    assert headline(plan_memory(_big())).startswith(
        "Qwen/Qwen3-30B-A3B (30.53B parameters, 3.35B active)"
    )
    dense = plan_memory(_big(model="8B"))
    assert dense.num_active_params == dense.num_params
    assert "active" not in headline(dense)


@pytest.mark.parametrize(
    ("changes", "shard_ranks"),
    [
        ({}, 16),
        ({"dp_replicate": 2}, 8),  # HSDP: each copy sharded over 8 ranks
        ({"placement": "disaggregated", "generator_ranks": 4}, 12),  # 11 of 128 experts each
        ({"dp_replicate": 16}, 1),  # DDP: every expert on every rank
    ],
)
def test_expert_bytes_per_rank_divide_by_the_fsdp_degree(changes, shard_ranks):
    plan = plan_memory(_big(**changes))
    role = "colocated" if "placement" not in changes else "trainer"
    rows = _rows(plan, role)
    per_expert = 3 * A3B.dim * A3B.moe_ffn_dim
    experts = A3B.num_layers * math.ceil(A3B.num_experts / shard_ranks) * per_expert
    # 'bf16-mixed': fp32 master weights.
    assert rows["weights: routed experts"] == experts * 4
    whole = TrainerBytes.of(ModelShapes.of(A3B, lora_rank=None), dtype="float32")
    held = TrainerBytes.of(
        ModelShapes.of(A3B, lora_rank=None), dtype="float32", num_ranks=shard_ranks
    )
    assert rows["weights: routed experts"] + rows["weights: the rest"] == held.weights
    assert rows["AdamW moments (2)"] == 2 * held.weights
    if shard_ranks == 1:
        assert held == whole


def test_the_generator_holds_every_expert_or_its_tp_share():
    split = {"placement": "disaggregated", "generator_ranks": 4}
    generator = _rows(plan_memory(_big(**split)), "generator")
    assert generator["generator weights: routed experts"] == A3B.expert_params * 2  # bf16
    whole = ModelShapes.of(A3B, lora_rank=None).sampler_numel * 2
    assert generator["generator weights: the rest"] == whole - A3B.expert_params * 2
    tp = _rows(plan_memory(_big(**split, generator_tp=2)), "generator")
    assert tp["generator weights: routed experts"] == A3B.expert_params
    # Colocated with a sharded trainer: every rank's generator holds every expert too.
    assert _rows(plan_memory(_big()))["generator weights: routed experts"] == (
        A3B.expert_params * 2
    )


def test_model_shapes_tell_experts_apart_and_gather_the_largest_block():
    config = training.tiny_model(family=FAMILY).config  # layer 0 dense, layer 1 sparse
    shapes = ModelShapes.of(config, lora_rank=None)
    assert shapes.expert_numel == config.expert_params > 0
    assert shapes.shard_numel(1, experts=True) == config.expert_params
    assert shapes.shard_numel(1, experts=False) == config.num_params - config.expert_params
    sparse_block = shapes.numel(prefix="blocks.1.")
    assert shapes.largest_block_numel == sparse_block > shapes.numel(prefix="blocks.0.")
    assert not is_expert("blocks.1.feed_forward.router.weight")
    rows = _rows(plan_memory(_settings(nproc_per_node=2, dtype="bfloat16"), decoder=config))
    assert rows["FSDP gathered: embeddings"] == (shapes.numel(root=True) + 2 * sparse_block) * 2


def test_one_process_plan_matches_the_trainer_tensors():
    engine = training.engine(family=FAMILY)
    rows = _rows(plan_memory(_settings(dtype="float32"), decoder=engine.model.config))
    experts = [p for name, p in engine.model.named_parameters() if is_expert(name)]
    held = _trained_bytes(engine)
    assert rows["weights: routed experts"] == _storage_bytes(experts)
    assert rows["weights: routed experts"] + rows["weights: the rest"] == held["trainable"]
    assert rows["gradients"] == held["gradients"]
    assert rows["AdamW moments (2)"] == held["moments"]


def _held_bytes(rank: int) -> dict[str, int]:
    engine = training.engine(family=FAMILY, dims=ParallelDims.Config(dp_shard=2))
    experts = [p for name, p in engine.model.named_parameters() if is_expert(name)]
    held = {"experts": _storage_bytes(experts), **_trained_bytes(engine)}
    del engine, experts
    return held


def test_fsdp_shards_of_uneven_experts_on_two_ranks_match_the_plan(tmp_path):
    """5 experts over 2 ranks: each holds storage for 3, as the plan counts (ceil(5 / 2))."""
    ranks = spawn(_held_bytes, world_size=2, out_dir=tmp_path)
    config = training.tiny_model(family=FAMILY).config
    rows = _rows(plan_memory(_settings(nproc_per_node=2, dtype="float32"), decoder=config))
    largest = {key: max(rank[key] for rank in ranks) for key in ranks[0]}
    # Rank 1's 2 experts sit in storage padded to 3 (FSDP2's even shards).
    expert_bytes = 3 * config.dim * config.moe_ffn_dim * 4
    assert [rank["experts"] for rank in ranks] == [3 * expert_bytes, 3 * expert_bytes]
    assert rows["weights: routed experts"] == largest["experts"]
    assert rows["weights: routed experts"] + rows["weights: the rest"] == largest["trainable"]
    assert rows["gradients"] == largest["gradients"]
    assert rows["AdamW moments (2)"] == largest["moments"]


def _saved_per_call(config, *, dtype: str, lora: bool, tokens: int) -> int:
    """What a forward of 2 x `tokens` tokens saves beyond one of `tokens`: what each call
    keeps whatever its tokens (autocast's casts, the experts' concatenated gate and up
    weights) drops out. LoRA adapts attention and the unembedding, and dense MLPs (the
    experts stay frozen)."""
    mixed = dtype == "bf16-mixed"
    model = materialize(config, dtype=("bfloat16" if lora else "float32") if mixed else dtype)
    if lora:
        apply_lora(model, LoraConfig(rank=4, train_mlp=config.num_sparse_layers == 0))
    if mixed:
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.float()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        return _saved_bytes(model, 2 * tokens) - _saved_bytes(model, tokens)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "bf16-mixed"])
@pytest.mark.parametrize(
    ("lora", "mlp_only_layers"),
    # With LoRA every layer is sparse: a dense MLP beside frozen experts would need adapters.
    [(False, ()), (False, (1,)), (True, ())],
)
def test_activation_estimate_of_sparse_layers_matches_what_autograd_saves(
    dtype, lora, mlp_only_layers
):
    """Within 6% (a dense model's: 5%; frozen experts under LoRA keep a little less than
    the shared coefficients assume), and what a sparse layer adds over a dense one of the
    same shape (the experts' term alone, without the shared coefficients' error) within 1% of
    the whole."""
    config = _sparse_config(mlp_only_layers=mlp_only_layers)
    dense = _sparse_config(mlp_only_layers=(0, 1, 2))
    tokens = 128
    kinds = {"dtype": dtype, "lora": lora}
    saved = _saved_per_call(config, **kinds, tokens=tokens)
    saved_dense = _saved_per_call(dense, **kinds, tokens=tokens)
    estimate = activation_bytes(config, tokens=tokens, **kinds, checkpointing="none")
    estimate_dense = activation_bytes(dense, tokens=tokens, **kinds, checkpointing="none")
    assert saved == pytest.approx(estimate, rel=0.06)
    assert saved - saved_dense == pytest.approx(estimate - estimate_dense, abs=0.01 * saved)
    assert estimate != estimate_dense  # a sparse layer's width is not ffn_dim's


def _sparse_config(**changes):
    shape = {"num_layers": 3, "num_heads": 8, "num_kv_heads": 2, "num_experts": 6, "top_k": 3}
    shape |= {"moe_ffn_dim": 96, "ffn_dim": 512}
    return dataclasses.replace(qwen3_moe_size("tiny", vocab_size=31), **{**shape, **changes})


def test_a_checkpointed_moe_recomputes_its_largest_block():
    def checkpointed(**changes) -> int:
        config = _sparse_config(**changes)
        return activation_bytes(
            config, tokens=1024, dtype="bfloat16", lora=False, checkpointing="full"
        )

    # Each block's input, and one block recomputed: the dense one when it is the larger.
    wide = {"ffn_dim": 8192}
    assert checkpointed(mlp_only_layers=(0,), **wide) == checkpointed(
        mlp_only_layers=(0, 1, 2), **wide
    )
    assert checkpointed(**wide) < checkpointed(mlp_only_layers=(0,), **wide)
    narrow = {"ffn_dim": 8}
    assert checkpointed(mlp_only_layers=(0,), **narrow) == checkpointed(**narrow)


def test_the_decode_graphs_hold_a_sparse_layers_temporaries():
    itemsize = 2
    expected = 16 * A3B.vocab_size * (4 + itemsize)
    qkv = 3 * A3B.num_heads * A3B.head_dim
    # Router logits (bf16) and softmax (fp32), and per top_k expert: the row, gate, up, output.
    sparse = A3B.top_k * (2 * A3B.moe_ffn_dim + 2 * A3B.dim) * itemsize
    sparse += A3B.num_experts * (itemsize + 4)
    expected += 16 * ((4 * A3B.dim + qkv) * itemsize + sparse)
    assert graph_pool_bytes(A3B, num_slots=16, dtype="bfloat16") == expected
    # ffn_dim is used by no layer of 30B-A3B: it does not count.
    assert graph_pool_bytes(
        dataclasses.replace(A3B, ffn_dim=1), num_slots=16, dtype="bfloat16"
    ) == (expected)
