"""Sharded training equals single-process training on all the data: FSDP2, DDP, TP, LoRA and
activation checkpointing under FSDP, custom losses, uneven micro-batch counts (2 gloo ranks),
FSDP x TP (4 ranks). Degrees that do not fit fail on every rank.

One spawn runs every 2-rank scenario (process start-up dominates on a small machine).
"""

from __future__ import annotations

import pytest
import torch

from temper.distributed.parallel_dims import ParallelDims
from temper.distributed.sharding import Sharding
from temper.trainer import LoraConfig, TrainerEngine
from tests.distributed import training
from tests.distributed.spawn import spawn

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
# Adam divides by sqrt(v): a gradient entry near zero that differs in its last bits (sums in
# another order) moves its weight by up to the learning rate's scale in the other direction.
# A wrong gradient (a missing rank, a double count) moves weights by ~1e-2 here.
WEIGHT_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}
LORA = LoraConfig(rank=4, alpha=8.0)
SCENARIOS = {
    # name: (engine kwargs, does each rank take its own share of the data)
    "fsdp": ({"dims": {"dp_shard": 2}}, True),
    "ddp": ({"dims": {"dp_replicate": 2, "dp_shard": 1}}, True),
    "tp": ({"dims": {"dp_shard": 1, "tp": 2}}, False),
    "fsdp_lora": ({"dims": {"dp_shard": 2}, "lora": LORA}, True),
    "fsdp_checkpointing": ({"dims": {"dp_shard": 2}, "activation_checkpointing": "full"}, True),
    # Micro-batches of one datum: the ranks run different numbers of them.
    "fsdp_microbatches": ({"dims": {"dp_shard": 2}, "max_tokens": 12}, True),
    "fsdp_custom_loss": ({"dims": {"dp_shard": 2}, "custom": True}, True),
    "tp_custom_loss": ({"dims": {"dp_shard": 1, "tp": 2}, "custom": True}, False),
}


def _run_scenarios(rank: int) -> dict:
    results = {}
    for name, (kwargs, data_parallel) in SCENARIOS.items():
        kwargs = {**kwargs, "dims": ParallelDims.Config(**kwargs["dims"])}
        custom = kwargs.pop("custom", False)
        engine = training.engine(**kwargs)
        # Data-parallel ranks each take every other datum; tp ranks share all of them. The
        # fsdp_microbatches ranks get uneven shares (5 and 3 datums).
        share = slice(None)
        if data_parallel:
            dp_rank = engine.sharding.dp_rank
            uneven = name == "fsdp_microbatches"
            share = (
                (slice(0, 5) if dp_rank == 0 else slice(5, None))
                if uneven
                else slice(dp_rank, None, 2)
            )
        results[name] = training.train(engine, share=share, custom=custom)
        del engine
    results["errors"] = _bad_degrees()
    results["fsdp_bf16"] = _train_bf16()
    return results


def _train_bf16() -> list[float]:
    """FSDP mixed precision (bf16 compute, fp32 reduction): the step losses."""
    sharding = Sharding.Config(
        dims=ParallelDims.Config(dp_shard=2), param_dtype="bfloat16", reduce_dtype="float32"
    )
    engine = TrainerEngine.Config(sharding=sharding).build(model=training.tiny_model(), lora=None)
    return training.train(engine, share=slice(engine.sharding.dp_rank, None, 2))["losses"]


def _bad_degrees() -> dict[str, str]:
    errors = {}
    bad = {
        "world_size": ParallelDims.Config(dp_shard=3),
        "tp_heads": ParallelDims.Config(dp_shard=1, tp=2),
    }
    for name, dims in bad.items():
        try:
            if name == "tp_heads":
                # 3 kv heads cannot be split 2 ways.
                training.engine_with_heads(dims=dims, num_heads=6, num_kv_heads=3)
            else:
                training.engine(dims=dims)
        except ValueError as error:
            errors[name] = str(error)
    return errors


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(_run_scenarios, world_size=2, out_dir=tmp_path_factory.mktemp("ranks"))


def _assert_matches(result: dict, reference: dict) -> None:
    torch.testing.assert_close(result["losses"], reference["losses"], **TOLERANCE)
    torch.testing.assert_close(result["grad_norms"], reference["grad_norms"], **TOLERANCE)
    torch.testing.assert_close(result["forward_losses"], reference["forward_losses"], **TOLERANCE)
    assert result["weights"].keys() == reference["weights"].keys()
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(
            result["weights"][name],
            tensor,
            **WEIGHT_TOLERANCE,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_train_like_one_process(results, scenario):
    kwargs, _ = SCENARIOS[scenario]
    reference = training.train(
        training.engine(lora=kwargs.get("lora")), custom=kwargs.get("custom", False)
    )
    for result in results:
        _assert_matches(result[scenario], reference)


def test_fsdp_bf16_mixed_precision_tracks_fp32_training(results):
    reference = training.train(training.engine())["losses"]
    for result in results:
        # bf16 keeps 8 bits of mantissa: losses agree to about 1%.
        torch.testing.assert_close(result["fsdp_bf16"], reference, rtol=2e-2, atol=0.0)
        assert result["fsdp_bf16"] != reference  # it did compute in bf16


def test_degrees_that_do_not_fit_fail_on_every_rank(results):
    for result in results:
        errors = result["errors"]
        assert "dp_shard (3)" in errors["world_size"] and "world size is 2" in errors["world_size"]
        assert "tp=2 must divide the model's num_kv_heads (3)" in errors["tp_heads"]


def _train_fsdp_times_tp(rank: int) -> dict:
    engine = training.engine(dims=ParallelDims.Config(dp_shard=2, tp=2))
    return training.train(engine, share=slice(engine.sharding.dp_rank, None, 2))


def test_fsdp_times_tp_on_four_ranks_trains_like_one_process(tmp_path):
    results = spawn(_train_fsdp_times_tp, world_size=4, out_dir=tmp_path)
    reference = training.train(training.engine())
    for result in results:
        _assert_matches(result, reference)
