"""The memory plan as text: `temper plan`'s tables and a rank's startup line."""

from __future__ import annotations

import re

import pytest

from temper.job import PlanSettings, describe_for_rank, plan_memory
from temper.job.memory_report import format_bytes, plan_text

SETTINGS = {"model": "8B", "nnodes": 2, "nproc_per_node": 8, "lora_rank": 32, "batch": 256}


def test_startup_line_of_a_rank_lists_its_items_and_the_verdict():
    plan = plan_memory(PlanSettings(**SETTINGS, max_seq_len=1024))
    line = describe_for_rank(plan, rank=3)
    # Without activation checkpointing an 8192-token micro-batch nearly fills the GPU.
    assert line.startswith(
        "memory plan, rank 3 (colocated): steady 19.28 GiB, peak 74.97 GiB while training, "
        "76.00 GiB usable (fits): base weights (frozen), 1/16 of bfloat16 976.4 MiB;"
    )
    assert line.endswith(
        "; CUDA context (estimate) 500.0 MiB; NCCL buffers (estimate): 1 communicator 256.0 MiB"
    )
    assert "; KV cache: 16 slots x 1024 tokens 2.25 GiB;" in line
    assert "gradients 11.0 MiB (training)" in line
    assert "\n" not in line


def test_startup_line_of_a_disaggregated_rank_names_its_role():
    settings = PlanSettings(**SETTINGS, placement="disaggregated", generator_ranks=4)
    plan = plan_memory(settings)
    assert "(generator)" in describe_for_rank(plan, rank=12, role="generator")
    assert "KV cache" not in describe_for_rank(plan, rank=0, role="trainer")
    with pytest.raises(ValueError, match="role 'colocated' is not in this plan"):
        describe_for_rank(plan, rank=0)


def test_plan_text_has_a_table_per_role_and_no_trailing_spaces():
    settings = PlanSettings(**SETTINGS, placement="disaggregated", generator_ranks=4)
    text = plan_text(plan_memory(settings))
    assert text.count("| item ") == 2
    assert all(line == line.rstrip() for line in text.splitlines())
    assert text.isascii()


def test_a_plan_that_does_not_fit_names_its_largest_item_and_what_shrinks_it():
    # README's example: 8B with LoRA on 2 x 8 ranks peaks over an 80 GiB GPU in activations.
    over = plan_text(plan_memory(PlanSettings(model="8B", nnodes=2, lora_rank=32)))
    assert "DOES NOT FIT" in over
    advice = over.splitlines()[-1]
    assert advice.startswith("colocated: over by ") and "activations (estimate)" in advice
    assert "--sharding.activation_checkpointing full" in advice
    # Following it, the plan fits and gives no advice.
    fits = PlanSettings(model="8B", nnodes=2, lora_rank=32, activation_checkpointing="full")
    assert plan_text(plan_memory(fits)).splitlines()[-1].startswith("fits: ")


def test_an_over_budget_generator_is_told_to_shrink_its_kv_cache():
    settings = PlanSettings(
        model="32B", nproc_per_node=2, placement="disaggregated", generator_ranks=1
    )
    advice = plan_text(plan_memory(settings)).splitlines()[-1]
    assert advice.startswith("generator: over by ")
    assert "KV cache" in advice and "--sampler.max_batch or --sampler.max_seq_len" in advice


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(0, "0"), (1536, "1.5 KiB"), (11 * 2**20, "11.0 MiB"), (int(2.25 * 2**30), "2.25 GiB")],
)
def test_bytes_read_in_the_unit_that_fits(num_bytes, text):
    assert format_bytes(num_bytes) == text


def test_weights_over_budget_suggest_what_the_plan_does_not_use_yet():
    def advice(lora_rank: int | None) -> list[str]:
        settings = PlanSettings(
            model="Qwen/Qwen3-235B-A22B",
            activation_checkpointing="full",
            nproc_per_node=8,
            placement="disaggregated",
            generator_ranks=4,
            lora_rank=lora_rank,
        )
        return plan_text(plan_memory(settings)).splitlines()[-2:]

    trainer, generator = advice(None)
    assert trainer.endswith("try more ranks (--nproc, --nnodes), or LoRA (--model.lora_rank)")
    assert generator.endswith(
        "try a larger --placement.generator_tp (each generator holds 1/tp of them)"
    )
    trainer, _ = advice(32)
    assert "base weights (frozen): routed experts" in trainer
    assert trainer.endswith("try more ranks (--nproc, --nnodes)")


def test_a_tiny_models_headline_counts_millions():
    text = plan_text(plan_memory(PlanSettings(model="qwen3_moe/tiny:digits")))
    assert re.match(r"qwen3_moe/tiny:digits \(\d+\.\d\dM parameters, \d+\.\d\dM active\)", text)
