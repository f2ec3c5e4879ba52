"""Sharded training equals single-process training on all the data: FSDP2, DDP, TP, LoRA and
activation checkpointing under FSDP, custom losses, uneven micro-batch counts (2 gloo ranks),
FSDP x TP (4 ranks). Degrees that do not fit fail on every rank.

One spawn runs every 2-rank scenario (process start-up dominates on a small machine).
"""

from __future__ import annotations

import pytest
import torch

from temper.api import Datum, ModelInput
from temper.distributed.parallel_dims import ParallelDims
from temper.trainer import LoraConfig, TrainerEngine
from temper.trainer.sharding import Sharding
from tests.distributed import training
from tests.distributed.spawn import spawn

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
# Adam divides by sqrt(v): a gradient entry near zero that differs in its last bits (sums in
# another order) moves its weight by up to the learning rate's scale in the other direction.
# A wrong gradient (a missing rank, a double count) moves weights by ~1e-2 here.
WEIGHT_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}
LORA = LoraConfig(rank=4, alpha=8.0)
# Which datums of each batch data-parallel rank 0 and rank 1 train on; tp ranks share all.
ALTERNATE = (slice(0, None, 2), slice(1, None, 2))
UNEVEN = (slice(0, 5), slice(5, None))
ALL_ON_RANK0 = (slice(None), slice(0, 0))
SCENARIOS = {
    # name: (engine kwargs, data shares of dp ranks 0 and 1, or None for tp)
    "fsdp": ({"dims": {"dp_shard": 2}}, ALTERNATE),
    "ddp": ({"dims": {"dp_replicate": 2, "dp_shard": 1}}, ALTERNATE),
    "tp": ({"dims": {"dp_shard": 1, "tp": 2}}, None),
    "fsdp_lora": ({"dims": {"dp_shard": 2}, "lora": LORA}, ALTERNATE),
    "fsdp_checkpointing": (
        {"dims": {"dp_shard": 2}, "activation_checkpointing": "full"},
        ALTERNATE,
    ),
    # Micro-batches of one datum: the ranks run different numbers of them.
    "fsdp_microbatches": ({"dims": {"dp_shard": 2}, "max_tokens": 12}, UNEVEN),
    # Rank 1 has no datums at all: it only runs empty passes.
    "fsdp_idle_rank": ({"dims": {"dp_shard": 2}}, ALL_ON_RANK0),
    "fsdp_custom_loss": ({"dims": {"dp_shard": 2}, "custom": True}, ALTERNATE),
    "fsdp_custom_loss_idle_rank": ({"dims": {"dp_shard": 2}, "custom": True}, ALL_ON_RANK0),
    "tp_custom_loss": ({"dims": {"dp_shard": 1, "tp": 2}, "custom": True}, None),
}


def _run_scenarios(rank: int) -> dict:
    results = {}
    for name, (kwargs, shares) in SCENARIOS.items():
        kwargs = {**kwargs, "dims": ParallelDims.Config(**kwargs["dims"])}
        custom = kwargs.pop("custom", False)
        engine = training.engine(**kwargs)
        share = slice(None) if shares is None else shares[engine.sharding.dp_rank]
        results[name] = training.train(engine, share=share, custom=custom)
        del engine
    results["errors"] = _bad_degrees()
    results["request_errors"] = _bad_request_on_one_rank(rank)
    results["fsdp_bf16"] = _train_bf16()
    results["fsdp_bf16_mixed"] = _train_bf16_mixed()
    return results


def _bad_request_on_one_rank(rank: int) -> dict[str, str]:
    """Rank 1 sends a bad datum / its custom loss fails; every rank must raise, none hang."""
    engine = training.engine(dims=ParallelDims.Config(dp_shard=2))
    data = training.batch(0)[rank::2]
    errors = {}
    bad = [*data[:-1], Datum(model_input=ModelInput.from_ints([1, 99]), loss_fn_inputs={})]
    try:
        engine.forward_backward(bad if rank == 1 else data, "cross_entropy")
    except ValueError as error:
        errors["datum"] = str(error)

    def failing_loss(data, logprobs):
        if rank == 1:
            raise ValueError("this loss fails on rank 1")
        return sum(lp.sum() for lp in logprobs), {}

    try:
        engine.forward_backward_custom(data, failing_loss)
    except ValueError as error:
        errors["custom"] = str(error)
    # The engine still works after both failures.
    errors["loss_after"] = engine.forward_backward(data, "cross_entropy").metrics["loss:sum"]
    return errors


def _train_bf16() -> list[float]:
    """FSDP mixed precision (bf16 compute, fp32 reduction): the step losses."""
    sharding = Sharding.Config(
        dims=ParallelDims.Config(dp_shard=2), param_dtype="bfloat16", reduce_dtype="float32"
    )
    engine = TrainerEngine.Config(sharding=sharding).build(model=training.tiny_model(), lora=None)
    return training.train(engine, share=slice(engine.sharding.dp_rank, None, 2))["losses"]


def _bf16_mixed_engine(
    dims: ParallelDims.Config | None, *, lora: LoraConfig | None = None
) -> TrainerEngine:
    """The 'bf16-mixed' precision: fp32 trained weights (a LoRA base in bf16), bf16 compute
    (FSDP's policy by default)."""
    sharding = None if dims is None else Sharding.Config(dims=dims)
    model = training.tiny_model()
    if lora is not None:
        model = model.to(torch.bfloat16)
    return TrainerEngine.Config(sharding=sharding).build(
        model=model, lora=lora, compute_dtype=torch.bfloat16
    )


def _train_bf16_mixed() -> dict:
    """FSDP under the 'bf16-mixed' precision, full and LoRA: the step losses and the dtypes
    it holds."""
    results = {}
    for name, lora in (("full", None), ("lora", LORA)):
        engine = _bf16_mixed_engine(ParallelDims.Config(dp_shard=2), lora=lora)
        gathered = set()  # a block's parameters' dtypes while it runs: FSDP's unsharded ones
        engine.model.blocks[0].register_forward_pre_hook(
            lambda block, _, gathered=gathered: gathered.update(p.dtype for p in block.parameters())
        )
        result = training.train(engine, share=slice(engine.sharding.dp_rank, None, 2))
        state = engine.optimizer.torch_optimizer.state
        moments = ("exp_avg", "exp_avg_sq")
        results[name] = {
            "losses": result["losses"],
            "trained": {p.dtype for p in engine.trainable}
            | {state[p][key].dtype for p in engine.trainable for key in moments},
            "frozen": {p.dtype for p in engine.model.parameters() if not p.requires_grad},
            "gathered": gathered,
        }
        del engine
    return results


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


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_fsdp_under_bf16_mixed_keeps_fp32_state_and_tracks_one_process(results, kind):
    """Sharded 'bf16-mixed': FSDP gathers bf16 without being told (Sharding's param_dtype
    unset), trained weights and moments stay fp32 (a LoRA base bf16), and the losses follow
    the one-process autocast run's."""
    lora = LORA if kind == "lora" else None
    reference = training.train(_bf16_mixed_engine(None, lora=lora))["losses"]
    fp32 = training.train(training.engine(lora=lora))["losses"]
    for result in results:
        mixed = result["fsdp_bf16_mixed"][kind]
        assert mixed["gathered"] == {torch.bfloat16}
        assert mixed["trained"] == {torch.float32}
        assert mixed["frozen"] == (set() if lora is None else {torch.bfloat16})
        torch.testing.assert_close(mixed["losses"], reference, rtol=2e-2, atol=0.0)
        torch.testing.assert_close(mixed["losses"], fp32, rtol=2e-2, atol=0.0)
        assert mixed["losses"] != fp32


def test_a_request_one_rank_rejects_fails_on_every_rank(results):
    rank0, rank1 = (result["request_errors"] for result in results)
    assert "token 99" in rank1["datum"]
    assert (
        rank0["datum"].startswith("rank 1 rejected the request:") and "token 99" in rank0["datum"]
    )
    assert rank1["custom"] == "this loss fails on rank 1"
    assert rank0["custom"] == "rank 1 rejected the request: this loss fails on rank 1"
    reference = training.engine().forward_backward(training.batch(0), "cross_entropy")
    expected = reference.metrics["loss:sum"]
    for errors in (rank0, rank1):
        torch.testing.assert_close(errors["loss_after"], expected, **TOLERANCE)


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
