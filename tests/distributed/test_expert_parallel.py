"""Expert parallelism (ParallelDims.Config.ep) on gloo ranks: a tiny Qwen3-MoE (2 layers, layer 0
dense, layer 1 with 4 routed experts) on 2 ranks with dp_shard=2, ep=2 (2 experts a rank), in
one spawn (process start-up dominates on a small machine):

- The experts module alone: each rank's outputs and input gradients, and its experts'
  gradients, are bitwise those of the plain module run in one process on the union of both
  ranks' rows; by per-expert slices and by the grouped kernel (offsets). An expert's rows
  arrive in rank order, the order a stable sort of the union gives them, so every matmul sees
  the same rows.
- Training (plain, activation checkpointing, uneven micro-batches with empty passes, LoRA on
  the experts) equals one process on all the data within the FSDP tests' tolerances, and
  FSDP alone on the same ranks likewise. Not bitwise: FSDP sums each rank's gradients of the
  dense weights after the ranks computed them (another order of float sums than one
  process's), with or without EP.
- Each rank holds half of the layer's experts (DTensors Shard(0) over ep) and gathers only
  those to run them; FSDP alone gathers all of them.
- DCP: a checkpoint of EP 2 loads under EP 1 (FSDP only, the same ranks), whose checkpoint
  loads under EP 2 again, and in one process: bitwise, and the reloaded EP run continues
  bitwise.
- Sampler weights: gathered whole, streamed in small buckets and as each rank's share (its
  own experts' rows): bitwise the unsharded weights.
- Sharded loading from a HF directory (one tensor per expert): each rank reads exactly its
  own experts.

On 4 ranks: ep=2 within dp_shard=4 (each rank's 2 experts FSDP-sharded over 2 more ranks),
with dp_replicate=2 (HSDP) and with tp=2 train like one process. Bad degrees fail before any
collective, naming the field.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from temper.checkpoint import sharded_load
from temper.checkpoint.dcp import load_train_state, save_train_state
from temper.checkpoint.gather import full_state_dict, sampler_share
from temper.checkpoint.hf import empty_pretrained, load_pretrained, save_pretrained
from temper.checkpoint.sharded_load import DeferredWeights
from temper.distributed.expert_parallel import apply_expert_parallel
from temper.distributed.local_shard import local_part
from temper.distributed.parallel_dims import ParallelDims
from temper.distributed.weight_pieces import as_rows
from temper.job.memory_plan import PlanSettings, plan_memory
from temper.models import materialize, qwen3_moe_size, qwen3_size
from temper.models.common.moe import GroupedExperts
from temper.trainer import LoraConfig, TrainerEngine
from temper.trainer.sharding import Sharding
from tests.checkpoint.test_sharded_load import _RecordedReads
from tests.distributed import training
from tests.distributed.spawn import spawn
from tests.distributed.test_checkpoint_and_gather import (
    _assert_equal,
    _full_state,
    _joined,
    _streamed,
    _train_steps,
)
from tests.distributed.test_sharded_training import ALTERNATE, UNEVEN, _assert_matches

NUM_EXPERTS = 4
EP = {"dp_shard": 2, "ep": 2}
LORA = LoraConfig(rank=4, alpha=8.0)
SCENARIOS = {
    "ep": ({"dims": EP}, ALTERNATE),
    "fsdp": ({"dims": {"dp_shard": 2}}, ALTERNATE),
    "ep_checkpointing": ({"dims": EP, "activation_checkpointing": "full"}, ALTERNATE),
    # Micro-batches of one datum: the ranks run different numbers of them (empty passes).
    "ep_microbatches": ({"dims": EP, "max_tokens": 12}, UNEVEN),
    "ep_lora": ({"dims": EP, "lora": LORA}, ALTERNATE),
    # FSDP gathers bf16 copies; rows go to the experts' rank in bf16.
    "ep_bf16_mixed": ({"dims": EP, "compute_dtype": torch.bfloat16}, ALTERNATE),
}
FOUR_RANKS = {
    "efsdp": {"dp_shard": 4, "ep": 2},
    "hsdp": {"dp_replicate": 2, "dp_shard": 2, "ep": 2},
    "tp": {"dp_shard": 2, "tp": 2, "ep": 2},
}
METADATA = {"policy_version": 2}


def _model() -> torch.nn.Module:
    return training.tiny_model(family="qwen3_moe", num_experts=NUM_EXPERTS)


def _engine(
    *,
    dims: dict | None = None,
    lora: LoraConfig | None = None,
    max_tokens: int = 8192,
    activation_checkpointing: str = "none",
    compute_dtype: torch.dtype | None = None,
) -> TrainerEngine:
    sharding = None
    if dims is not None:
        sharding = Sharding.Config(
            dims=ParallelDims.Config(**dims), activation_checkpointing=activation_checkpointing
        )
    config = TrainerEngine.Config(max_tokens_per_microbatch=max_tokens, sharding=sharding)
    return config.build(model=_model(), lora=lora, compute_dtype=compute_dtype)


# -- the experts module alone ----------------------------------------------------------------

DIM, HIDDEN = 16, 8  # 16-byte strides in fp32: the grouped kernel runs on CPU too
ROW_COUNTS = ([3, 0, 2, 4], [1, 5, 0, 2])  # rank r's rows per expert; some get none


def _plain_experts() -> GroupedExperts:
    experts = GroupedExperts(num_experts=NUM_EXPERTS, dim=DIM, hidden_dim=HIDDEN)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return experts


def _rows(rank: int) -> dict:
    """Rank `rank`'s rows sorted by expert, their router weights and an output gradient."""
    generator = torch.Generator().manual_seed(10 + rank)
    num_rows = sum(ROW_COUNTS[rank])
    return {
        "x": torch.randn(num_rows, DIM, generator=generator),
        "weights": torch.rand(num_rows, generator=generator),
        "grad": torch.randn(num_rows, DIM, generator=generator),
        "counts": ROW_COUNTS[rank],
    }


def _takes_router_weights() -> bool:
    return "weights_A" in inspect.signature(GroupedExperts.forward).parameters


def _run_experts(experts, rows: dict, *, grouped: bool) -> dict:
    """Forward and backward of `experts` on `rows`: outputs, input and expert gradients."""
    x = rows["x"].clone().requires_grad_()
    counts = rows["counts"]
    if grouped:
        offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
        kwargs = {"counts_E": None, "offsets_E": offsets}
    else:
        kwargs = {"counts_E": counts, "offsets_E": None}
    weights = None
    if _takes_router_weights():
        weights = rows["weights"].clone().requires_grad_()
        kwargs["weights_A"] = weights
    for parameter in experts.parameters():
        parameter.grad = None
    out = experts(x, **kwargs)
    out.backward(rows["grad"])
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "weights_grad": None if weights is None else weights.grad,
        "expert_grads": {n: local_part(p.grad).clone() for n, p in experts.named_parameters()},
    }


def _experts_module(rank: int) -> dict:
    experts = _plain_experts()
    apply_expert_parallel(experts, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
    return {
        "placements": {n: p.placements for n, p in experts.named_parameters()},
        "sliced": _run_experts(experts, _rows(rank), grouped=False),
        "grouped": _run_experts(experts, _rows(rank), grouped=True),
    }


def _union() -> tuple[dict, list[list[int]]]:
    """Both ranks' rows in one batch sorted by expert (each expert's rank 0 rows first), and
    where each rank's rows landed in it."""
    ranks = [_rows(rank) for rank in range(2)]
    pieces: dict[str, list] = {"x": [], "weights": [], "grad": []}
    places: list[list[int]] = [[], []]
    starts = [[sum(r["counts"][:e]) for e in range(NUM_EXPERTS)] for r in ranks]
    position = 0
    for expert in range(NUM_EXPERTS):
        for rank, rows in enumerate(ranks):
            count, start = rows["counts"][expert], starts[rank][expert]
            for key in pieces:
                pieces[key].append(rows[key][start : start + count])
            places[rank].extend(range(position, position + count))
            position += count
    union = {key: torch.cat(value) for key, value in pieces.items()}
    union["counts"] = [sum(r["counts"][e] for r in ranks) for e in range(NUM_EXPERTS)]
    return union, places


# -- training, checkpoints, sampler weights, loading --------------------------------------------


def _train_scenarios(rank: int) -> dict:
    results = {}
    for name, (kwargs, shares) in SCENARIOS.items():
        engine = _engine(**kwargs)
        experts = engine.model.blocks[1].feed_forward.experts
        gathered: list[tuple[int, ...]] = []
        # After FSDP's pre-forward hook: the experts as they are gathered to run.
        experts.register_forward_pre_hook(
            lambda module, args, seen=gathered: seen.append(tuple(local_part(module.w_gate).shape))
        )
        results[name] = training.train(engine, share=shares[engine.sharding.dp_rank])
        results[name]["held"] = {
            n: (type(p).__name__, getattr(p, "placements", None), tuple(local_part(p).shape))
            for n, p in experts.named_parameters()
        }
        results[name]["gathered"] = sorted(set(gathered))
        del engine
    return results


def _state(engine: TrainerEngine) -> dict:
    """Weights and optimizer state, whole, copied: the optimizer's own state tensors (its step
    counts) change with its next step."""
    return copy.deepcopy(_full_state(engine))


def _checkpoints(rank: int, directory: Path) -> dict:
    """EP 2 -> EP 1 (FSDP only) -> EP 2, and the sampler weights of the EP run."""
    results = {}
    engine = _engine(dims=EP)
    _train_steps(engine)
    save_train_state(
        directory / "ep",
        model=engine.model,
        optimizer=engine.optimizer.torch_optimizer,
        metadata=METADATA,
        trainable_only=False,
    )
    results["saved"] = _state(engine)
    results["streamed"] = _streamed(engine.model)
    share = [as_rows(piece) for piece in sampler_share(engine.model, lead=rank == 0)]
    results["share"] = [(p.name, p.start, p.value.clone()) for p in share]
    _train_steps(engine, steps=1)  # a third step, for the resumed run to repeat
    results["continued"] = full_state_dict(engine.model)
    del engine

    fsdp = _engine(dims={"dp_shard": 2})
    load_train_state(
        directory / "ep",
        model=fsdp.model,
        optimizer=fsdp.optimizer.torch_optimizer,
        trainable_only=False,
    )
    results["ep_to_fsdp"] = _state(fsdp)
    save_train_state(
        directory / "fsdp",
        model=fsdp.model,
        optimizer=fsdp.optimizer.torch_optimizer,
        metadata=METADATA,
        trainable_only=False,
    )
    del fsdp

    engine = _engine(dims=EP)
    load_train_state(
        directory / "fsdp",
        model=engine.model,
        optimizer=engine.optimizer.torch_optimizer,
        trainable_only=False,
    )
    results["fsdp_to_ep"] = _state(engine)
    _train_steps(engine, steps=1)
    results["resumed"] = full_state_dict(engine.model)
    del engine
    return results


def _moe_config():
    """Untied (the output is read from its own tensor), 4 experts in layer 1."""
    return dataclasses.replace(_model().config, tie_embeddings=False)


def _sharded_load(moe_dir: Path) -> dict:
    reads = _RecordedReads()
    with mock.patch.object(sharded_load, "safe_open", reads):
        engine = TrainerEngine.Config(
            sharding=Sharding.Config(dims=ParallelDims.Config(**EP))
        ).build(
            model=empty_pretrained(moe_dir, device="meta"),
            lora=None,
            weights=DeferredWeights(device=torch.device("cpu"), model_dir=moe_dir),
        )
    experts = engine.model.blocks[1].feed_forward.experts
    return {
        "weights": full_state_dict(engine.model),
        "read_bytes": sum(reads.nbytes),
        "local_bytes": sum(local_part(p).numel() * 4 for p in engine.model.parameters()),
        "expert_bytes": sum(local_part(p).numel() * 4 for p in experts.parameters()),
    }


def _two_ranks(rank: int, directory: Path, moe_dir: Path) -> dict:
    return {
        "module": _experts_module(rank),
        "training": _train_scenarios(rank),
        "checkpoints": _checkpoints(rank, directory),
        "sharded_load": _sharded_load(moe_dir),
    }


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hf") / "tiny_moe"
    save_pretrained(materialize(_moe_config(), seed=5), directory)
    return directory


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, moe_dir) -> tuple[list[dict], Path]:
    directory = tmp_path_factory.mktemp("checkpoints")
    results = spawn(
        _two_ranks,
        world_size=2,
        out_dir=tmp_path_factory.mktemp("ranks"),
        args=(directory, moe_dir),
    )
    return results, directory


@pytest.mark.parametrize("grouped", [False, True], ids=["sliced", "grouped"])
def test_expert_parallel_experts_equal_one_process_on_the_union_of_rows(two_ranks, grouped):
    """Bitwise by per-expert slices (the CPU path). The grouped kernel (CUDA's path, run here
    by torch's CPU fallback) blocks its work by the whole call's rows, so the same rows in a
    larger call differ in the last bits: to float rounding."""
    union, places = _union()
    expected = _run_experts(_plain_experts(), union, grouped=grouped)
    close = torch.testing.assert_close if grouped else _assert_bitwise
    local = NUM_EXPERTS // 2
    for rank, result in enumerate(two_ranks[0]):
        module = result["module"]
        assert set(module["placements"].values()) == {(Shard(0),)}
        got = module["grouped" if grouped else "sliced"]
        place = torch.tensor(places[rank])
        close(got["out"], expected["out"][place])
        close(got["x_grad"], expected["x_grad"][place])
        if expected["weights_grad"] is not None:
            close(got["weights_grad"], expected["weights_grad"][place])
        mine = slice(rank * local, (rank + 1) * local)
        for name, grad in expected["expert_grads"].items():
            close(got["expert_grads"][name], grad[mine], msg=name)


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    assert torch.equal(actual, expected), msg


@pytest.mark.parametrize("scenario", [name for name in SCENARIOS if "bf16" not in name])
def test_two_ranks_with_expert_parallelism_train_like_one_process(two_ranks, scenario):
    kwargs, _ = SCENARIOS[scenario]
    reference = training.train(_engine(lora=kwargs.get("lora")))
    for result in two_ranks[0]:
        _assert_matches(result["training"][scenario], reference)


def test_bf16_mixed_precision_under_expert_parallelism_tracks_fp32_training(two_ranks):
    reference = training.train(_engine())["losses"]
    for result in two_ranks[0]:
        losses = result["training"]["ep_bf16_mixed"]["losses"]
        # bf16 keeps 8 bits of mantissa: losses agree to about 1%.
        torch.testing.assert_close(losses, reference, rtol=2e-2, atol=0.0)
        assert losses != reference  # it did compute in bf16


def test_each_rank_holds_and_gathers_half_of_the_experts(two_ranks):
    config = _model().config
    dim, hidden = config.dim, config.moe_ffn_dim
    for result in two_ranks[0]:
        ep, fsdp = result["training"]["ep"], result["training"]["fsdp"]
        # Between steps each rank holds 2 of the 4 experts either way.
        assert ep["held"]["w_gate"][2] == fsdp["held"]["w_gate"][2] == (2, hidden, dim)
        assert ep["held"]["w_down"][2] == (2, dim, hidden)
        assert all(held[0] == "DTensor" for held in ep["held"].values())
        # Expert parallelism gathers its ep part (its 2 experts); FSDP alone all 4.
        assert ep["gathered"] == [(2, hidden, dim)]
        assert fsdp["gathered"] == [(4, hidden, dim)]
        # LoRA factors on the experts are split over ep like the experts.
        lora = result["training"]["ep_lora"]["held"]
        assert lora["w_gate_adapter.lora_A"][2][0] == 2


def test_the_plan_counts_the_expert_bytes_each_rank_holds_and_gathers(two_ranks):
    config = _model().config  # one sparse layer
    settings = PlanSettings(model="tiny", nproc_per_node=2, dtype="float32", ep=2, batch=4)
    rows = plan_memory(settings, decoder=config).role("colocated").rows
    held_row = next(row for row in rows if row.item.startswith("weights: routed experts"))
    for result in two_ranks[0]:
        held = result["training"]["ep"]["held"].values()
        assert held_row.num_bytes == sum(math.prod(shape) * 4 for _, _, shape in held)
        # What runs a sparse layer: the 3 weights of its ep part (2 experts), as the plan's
        # gathered block counts them.
        (shape,) = result["training"]["ep"]["gathered"]
        assert 3 * math.prod(shape) == config.expert_params // 2


def test_checkpoints_load_across_expert_parallel_degrees_bitwise(two_ranks):
    ranks, directory = two_ranks
    for rank in ranks:
        checkpoints = rank["checkpoints"]
        _assert_equal(checkpoints["ep_to_fsdp"], checkpoints["saved"], "ep -> fsdp")
        _assert_equal(checkpoints["fsdp_to_ep"], checkpoints["saved"], "fsdp -> ep")
        _assert_equal(checkpoints["resumed"], checkpoints["continued"], "resumed")
    single = _engine()
    metadata = load_train_state(
        directory / "ep",
        model=single.model,
        optimizer=single.optimizer.torch_optimizer,
        trainable_only=False,
    )
    assert metadata == METADATA
    _assert_equal(_full_state(single), ranks[0]["checkpoints"]["saved"], "ep -> one process")


def test_sampler_weights_of_an_expert_parallel_model_equal_the_unsharded_ones(two_ranks):
    ranks, _ = two_ranks
    expected = ranks[0]["checkpoints"]["saved"]["weights"]
    for rank in ranks:
        streamed, _, in_place = rank["checkpoints"]["streamed"]
        _assert_equal(streamed, expected)
        _assert_equal(in_place, expected)
    shares = [rank["checkpoints"]["share"] for rank in ranks]
    _assert_equal(_joined(shares, expected), expected)
    # Each rank sends the rows of its own experts.
    for rank, share in enumerate(shares):
        rows = {(start, value.shape[0]) for name, start, value in share if "experts" in name}
        assert rows == {(2 * rank, 2)}, rows


def test_sharded_loading_reads_only_each_ranks_experts(two_ranks, moe_dir):
    expected = load_pretrained(moe_dir).state_dict()
    config = _moe_config()
    expert_bytes = NUM_EXPERTS * 3 * config.dim * config.moe_ffn_dim * 4
    for rank in two_ranks[0]:
        loaded = rank["sharded_load"]
        _assert_equal(loaded["weights"], expected)
        assert loaded["read_bytes"] == loaded["local_bytes"]  # exactly its own slices
        assert loaded["expert_bytes"] == expert_bytes // 2


def _four_ranks(rank: int) -> dict:
    results = {}
    for name, dims in FOUR_RANKS.items():
        engine = _engine(dims=dims)
        dp = engine.sharding.dp_mesh.size()
        results[name] = training.train(engine, share=slice(engine.sharding.dp_rank, None, dp))
        experts = engine.model.blocks[1].feed_forward.experts
        results[name]["local_experts"] = local_part(experts.w_gate).shape[0]
        del engine
    return results


def test_expert_parallelism_composes_with_fsdp_hsdp_and_tp_on_four_ranks(tmp_path):
    results = spawn(_four_ranks, world_size=4, out_dir=tmp_path)
    reference = training.train(_engine())
    for result in results:
        for name in FOUR_RANKS:
            _assert_matches(result[name], reference)
        # 2 experts per ep rank, FSDP-sharded over the other 2 dp_shard ranks: 1 each.
        assert result["efsdp"]["local_experts"] == 1
        assert result["hsdp"]["local_experts"] == result["tp"]["local_experts"] == 2


def _tiny_moe(**changes):
    return dataclasses.replace(qwen3_moe_size("tiny", vocab_size=31), **changes)


def test_bad_expert_parallel_degrees_fail_naming_the_field():
    with pytest.raises(ValueError, match=r"ParallelDims.Config.ep must be an int >= 1, got 0"):
        ParallelDims.Config(ep=0)
    # ep borrows from dp_shard: 4 ranks with tp=2 leave dp_shard=2.
    with pytest.raises(ValueError, match=r"ep=4 must divide dp_shard \(2: world size 4"):
        ParallelDims(ParallelDims.Config(tp=2, ep=4), world_size=4)
    with pytest.raises(ValueError, match=r"ep=2 must divide dp_shard \(3"):
        ParallelDims(ParallelDims.Config(ep=2), world_size=3)
    dims = ParallelDims(ParallelDims.Config(ep=4), world_size=4)
    with pytest.raises(ValueError, match=r"ep=4 must divide the model's num_experts \(6\)"):
        dims.check_model(_tiny_moe(num_experts=6))
    with pytest.raises(ValueError, match=r"ep=4 needs a model with routed experts"):
        dims.check_model(qwen3_size("tiny"))
    dims.check_model(_tiny_moe(num_experts=8))
