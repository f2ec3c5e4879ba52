"""The memory plan of a MoE trainer with expert parallelism (PlanSettings.ep): a rank holds as
many expert bytes between steps as under FSDP alone (E / ep experts of its ep part, sharded over
the shard ranks / ep), gathers only its part of a sparse block to run it, and takes part in the
expert mesh's groups; bad degrees fail naming the field. What 2 gloo ranks hold is checked
against the plan in tests/distributed/test_expert_parallel.py."""

from __future__ import annotations

import dataclasses

import pytest

from temper.job.memory_plan import ModelShapes, PlanSettings, plan_memory
from temper.job.runtime_bytes import nccl_communicators
from temper.models import QWEN3_MOE_SIZES

A3B = QWEN3_MOE_SIZES["30B-A3B"]
PER_EXPERT = 3 * A3B.dim * A3B.moe_ffn_dim


def _big(**changes) -> PlanSettings:
    """Qwen3-30B-A3B, full fine-tuning under 'bf16-mixed' on 2 x 8 ranks."""
    base = {"model": "Qwen/Qwen3-30B-A3B", "nnodes": 2, "nproc_per_node": 8, "dtype": "bf16-mixed"}
    return PlanSettings(**{**base, "batch": 256, "max_seq_len": 1024, **changes})


def _rows(plan, role: str = "colocated") -> dict[str, int]:
    """Bytes by item name (the text before the first comma)."""
    return {row.item.split(",")[0]: row.num_bytes for row in plan.role(role).rows}


@pytest.mark.parametrize(
    ("changes", "experts_per_rank"),
    [
        ({"ep": 8}, 8),  # 16 experts an ep rank, over 2 FSDP ranks
        ({"ep": 16}, 8),
        ({"ep": 2, "dp_replicate": 2}, 16),  # HSDP: 8 shard ranks, 64 experts an ep rank
        ({"ep": 4, "placement": "disaggregated", "generator_ranks": 4}, 11),  # 32 over 3
    ],
)
def test_a_rank_holds_its_ep_parts_share_of_the_experts(changes, experts_per_rank):
    plan = plan_memory(_big(**changes))
    role = "trainer" if "placement" in changes else "colocated"
    rows = _rows(plan, role)
    held = A3B.num_layers * experts_per_rank * PER_EXPERT * 4  # fp32 master weights
    assert rows["weights: routed experts"] == held
    # The same as FSDP alone where the shares are even; gradients and moments shrink alike.
    if experts_per_rank != 11:
        fsdp = _rows(plan_memory(_big(**{**changes, "ep": 1})), role)
        assert rows["weights: routed experts"] == fsdp["weights: routed experts"]
        assert rows["AdamW moments (2)"] == fsdp["AdamW moments (2)"]


def test_a_rank_gathers_only_its_ep_part_of_a_sparse_block():
    shapes = ModelShapes.of(A3B, lora_rank=None)
    block_experts = A3B.num_experts * PER_EXPERT
    block = shapes.largest_block_numel
    assert shapes.gathered_block_numel(ep=1) == block
    assert shapes.gathered_block_numel(ep=8) == block - block_experts + block_experts // 8
    rows = {row.item: row.num_bytes for row in plan_memory(_big(ep=8)).role("colocated").rows}
    root = shapes.numel(root=True)
    gathered = rows["FSDP gathered: embeddings, output, 2 blocks (1/8 of the experts)"]
    assert gathered == (root + 2 * shapes.gathered_block_numel(ep=8)) * 2  # bf16
    fsdp = {row.item: row.num_bytes for row in plan_memory(_big()).role("colocated").rows}
    # 2 x 7/8 of a layer's experts in bf16: about 2.1 GB less.
    saved = fsdp["FSDP gathered: embeddings, output, 2 blocks"] - gathered
    assert saved == 2 * (block_experts - block_experts // 8) * 2
    assert "experts ep 8" in plan_memory(_big(ep=8)).role("colocated").description


def test_the_expert_mesh_adds_its_groups():
    # 16 ranks, ep 8: efsdp (2 ranks) and ep (8 ranks) beside the default group.
    assert nccl_communicators(
        "colocated", world_size=16, trainer_ranks=16, dp_replicate=1, ep=8
    ) == ("default", "mesh efsdp", "mesh ep")
    # ep over all 16: its group is the default one, and efsdp has one rank.
    assert nccl_communicators(
        "colocated", world_size=16, trainer_ranks=16, dp_replicate=1, ep=16
    ) == ("default",)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"ep": 0}, "ep must be an int >= 1, got 0"),
        ({"ep": 3}, "ep=3 must divide the 16 ranks each copy of the weights is sharded over"),
        ({"ep": 16, "dp_replicate": 2}, "ep=16 must divide the 8 ranks"),
        ({"ep": 2, "model": "8B"}, "ep=2 must divide the model's routed experts; it has a dense"),
    ],
)
def test_bad_expert_parallel_degrees_fail_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        plan_memory(_big(**changes))


def test_ep_must_divide_the_experts():
    plan_memory(_big(ep=16))  # 128 experts
    six = dataclasses.replace(QWEN3_MOE_SIZES["tiny"], num_experts=6)
    settings = PlanSettings(model="qwen3_moe/tiny", nproc_per_node=4, ep=4, batch=4)
    with pytest.raises(ValueError, match=r"ep=4 must divide .* it has num_experts \(6\)"):
        plan_memory(settings, decoder=six)
