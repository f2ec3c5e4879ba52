"""On 2 gloo ranks: gathered sampler weights equal the unsharded model's bitwise (whole,
streamed in row ranges, and as each rank's share for generator ranks); DCP train
state saved on 2 ranks loads on 1 and saved on 1 loads on 2, bitwise; an incompatible
checkpoint fails on every rank.

One spawn runs every scenario (process start-up dominates on a small machine).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from temper.api import Datum, ModelInput
from temper.checkpoint.dcp import load_train_state, save_train_state
from temper.checkpoint.gather import (
    full_state_dict,
    sampler_share,
    sampler_state_dict,
    sampler_stream,
)
from temper.client.service_client import ServiceClient
from temper.distributed.parallel_dims import ParallelDims
from temper.distributed.weight_pieces import RowCoverage, WeightRows, as_rows
from temper.models.build import materialize
from temper.models.lora import apply_lora, merged_config, merged_state_dict
from temper.sampler.weight_source import WeightSource
from temper.trainer import LoraConfig, TrainerEngine
from temper.trainer.sharding import Sharding
from tests.distributed import training
from tests.distributed.spawn import spawn

DIMS = {"fsdp": {"dp_shard": 2}, "tp": {"dp_shard": 1, "tp": 2}}
LORA = LoraConfig(rank=4, alpha=8.0)
METADATA = {"policy_version": 2}
STREAM_BUCKET = 2048  # bytes: every larger tensor comes in several row ranges


def _train_steps(engine, *, steps: int = 2) -> None:
    for step in range(steps):
        engine.forward_backward(training.batch(step), "cross_entropy")
        engine.optim_step(training.ADAM)


def _full_state(engine) -> dict:
    """Weights and optimizer state, whole (collective when sharded)."""
    options = StateDictOptions(full_state_dict=True)
    optimizer = get_optimizer_state_dict(
        engine.model, engine.optimizer.torch_optimizer, options=options
    )
    return {"weights": full_state_dict(engine.model), "optimizer": optimizer}


def _lora_model_with_adapters() -> torch.nn.Module:
    model = training.tiny_model()
    apply_lora(model, LORA)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


def _streamed(model: torch.nn.Module) -> tuple[dict, int, dict]:
    """A plain model loaded from `sampler_stream` in small buckets (each piece copied as it
    is drawn), the number of pieces, and a model that loaded the stream itself (the rows of
    other ranks received straight into it)."""
    pieces = []
    for piece in sampler_stream(model, bucket_bytes=STREAM_BUCKET):  # each valid until the next
        rows = as_rows(piece)
        pieces.append(WeightRows(name=rows.name, start=rows.start, value=rows.value.clone()))
    source = WeightSource(materialize(merged_config(model), init="empty"))
    source.update(iter(pieces), version=1)
    in_place = WeightSource(materialize(merged_config(model), init="empty"))
    in_place.update(sampler_stream(model, bucket_bytes=STREAM_BUCKET), version=1)
    return full_state_dict(source.model), len(pieces), full_state_dict(in_place.model)


def _scenarios(rank: int, directory, single_checkpoint) -> dict:
    results = {"gathered": {}, "saved": {}, "loaded": None, "incompatible": None}
    results |= {"streamed": {}, "shares": {}}
    for name, dims in DIMS.items():
        engine = training.engine(dims=ParallelDims.Config(**dims))
        results["gathered"][name] = full_state_dict(engine.model)
        results["streamed"][name] = _streamed(engine.model)
        share = [as_rows(piece) for piece in sampler_share(engine.model, lead=rank == 0)]
        results["shares"][name] = [(p.name, p.start, p.value.clone()) for p in share]
        _train_steps(engine)
        save_train_state(
            directory / name,
            model=engine.model,
            optimizer=engine.optimizer.torch_optimizer,
            metadata=METADATA,
            trainable_only=False,
        )
        results["saved"][name] = _full_state(engine)
        del engine

    model = _lora_model_with_adapters()
    expected = merged_state_dict(copy.deepcopy(model))
    Sharding.Config(dims=ParallelDims.Config(dp_shard=2)).build(model=model)
    merged = sampler_state_dict(model)
    results["lora_merged_equal"] = merged.keys() == expected.keys() and all(
        torch.equal(merged[key], expected[key]) for key in expected
    )
    share = [as_rows(piece) for piece in sampler_share(model, lead=rank == 0)]
    results["lora_share"] = [(p.name, p.start, p.value.clone()) for p in share]
    results["lora_expected"] = expected
    streamed, _, in_place = _streamed(model)
    results["lora_streamed_equal"] = all(
        loaded.keys() == expected.keys()
        and all(torch.equal(loaded[key], expected[key]) for key in expected)
        for loaded in (streamed, in_place)
    )
    del model

    engine = training.engine(dims=ParallelDims.Config(dp_shard=2))
    load_train_state(
        single_checkpoint,
        model=engine.model,
        optimizer=engine.optimizer.torch_optimizer,
        trainable_only=False,
    )
    results["loaded"] = _full_state(engine)
    del engine

    results["client_sampler"] = _client_sampler_weights(rank, directory)

    wider = training.engine_with_heads(
        dims=ParallelDims.Config(dp_shard=2), num_heads=8, num_kv_heads=2
    )
    try:
        load_train_state(single_checkpoint, model=wider.model, optimizer=None, trainable_only=False)
    except ValueError as error:
        results["incompatible"] = str(error)
    return results


def _client_sampler_weights(rank: int, directory) -> dict:
    """A sharded TrainingClient's sampler after one step: its weights and the gathered ones."""
    trainer = TrainerEngine.Config(sharding=Sharding.Config(dims=ParallelDims.Config(dp_shard=2)))
    service = ServiceClient(storage_dir=directory / f"client{rank}", trainer=trainer)
    client = service.create_training_client("tiny")
    tokens = [1, 2, 3, 4, 5, 6]
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 5},
    )
    client.forward_backward([datum] * (rank + 1), "cross_entropy").result()
    client.optim_step(training.ADAM).result()
    sampler = client.save_weights_and_get_sampling_client()
    return {
        "sampler": {k: v.clone() for k, v in sampler.generator.model.state_dict().items()},
        # On the client's worker, in order with its other collectives.
        "trainer": client._worker.submit(full_state_dict, client.engine.model).result(),
    }


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    """A single-process run of the same steps, saved to a checkpoint."""
    engine = training.engine()
    _train_steps(engine)
    directory = tmp_path_factory.mktemp("single") / "checkpoint"
    save_train_state(
        directory,
        model=engine.model,
        optimizer=engine.optimizer.torch_optimizer,
        metadata=METADATA,
        trainable_only=False,
    )
    return {"directory": directory, "state": _full_state(engine)}


@pytest.fixture(scope="module")
def results(tmp_path_factory, single) -> tuple[list[dict], object]:
    directory = tmp_path_factory.mktemp("sharded")
    ranks = spawn(
        _scenarios,
        world_size=2,
        out_dir=tmp_path_factory.mktemp("ranks"),
        args=(directory, single["directory"]),
    )
    return ranks, directory


def _assert_equal(actual, expected, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            _assert_equal(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_equal(a, e, f"{where}.{index}")
    else:
        assert actual == expected, where


@pytest.mark.parametrize("dims", list(DIMS))
def test_gathered_weights_equal_the_unsharded_model(results, dims):
    expected = training.tiny_model().state_dict()
    for rank in results[0]:
        _assert_equal(rank["gathered"][dims], expected)


def test_gathered_lora_sampler_weights_equal_the_unsharded_merge(results):
    assert all(rank["lora_merged_equal"] for rank in results[0])
    assert all(rank["lora_streamed_equal"] for rank in results[0])


@pytest.mark.parametrize("dims", list(DIMS))
def test_weights_streamed_in_small_buckets_equal_the_unsharded_model(results, dims):
    expected = training.tiny_model().state_dict()
    for rank in results[0]:
        streamed, pieces, in_place = rank["streamed"][dims]
        _assert_equal(streamed, expected)
        _assert_equal(in_place, expected)
        if dims == "fsdp":  # row ranges of at most a bucket, not whole tensors
            assert pieces > 2 * len(expected), pieces


def _joined(shares: list[list[tuple]], like: dict) -> dict:
    """The ranks' shares put together (each row exactly once, or a ValueError)."""
    whole = {name: torch.full_like(value, float("nan")) for name, value in like.items()}
    coverage = RowCoverage(whole)
    for share in shares:
        for name, start, value in share:
            coverage.check(WeightRows(name=name, start=start, value=value)).copy_(value)
    assert coverage.missing() == []
    return whole


@pytest.mark.parametrize("dims", list(DIMS))
def test_the_ranks_shares_make_up_the_whole_weights_once(results, dims):
    """Each rank sends its own rows of the tensors split by rows only (FSDP's, TP's column
    splits) and rank 0 the rest whole: together exactly the unsharded weights."""
    expected = training.tiny_model().state_dict()
    _assert_equal(_joined([rank["shares"][dims] for rank in results[0]], expected), expected)
    assert results[0][1]["shares"][dims], "rank 1 sends rows of its own"


def test_lora_shares_make_up_the_merged_weights_once(results):
    """Under FSDP with LoRA, rank 0 sends the merged weights whole, and each rank its rows of
    the rest (norms, embeddings): together exactly the single-process merge."""
    expected = results[0][0]["lora_expected"]
    _assert_equal(_joined([rank["lora_share"] for rank in results[0]], expected), expected)
    assert results[0][1]["lora_share"], "rank 1 sends rows of its own"


@pytest.mark.parametrize("dims", list(DIMS))
def test_checkpoint_from_two_ranks_loads_on_one_bitwise(results, dims):
    ranks, directory = results
    engine = training.engine()
    metadata = load_train_state(
        directory / dims,
        model=engine.model,
        optimizer=engine.optimizer.torch_optimizer,
        trainable_only=False,
    )
    assert metadata == METADATA
    _assert_equal(_full_state(engine), ranks[0]["saved"][dims])


def test_checkpoint_from_one_rank_loads_on_two_bitwise(results, single):
    for rank in results[0]:
        _assert_equal(rank["loaded"], single["state"])


def test_sharded_training_client_syncs_whole_weights_to_each_rank_sampler(results):
    for rank in results[0]:
        _assert_equal(rank["client_sampler"]["sampler"], rank["client_sampler"]["trainer"])
    # Both ranks sample from the same whole weights.
    _assert_equal(
        results[0][0]["client_sampler"]["sampler"], results[0][1]["client_sampler"]["sampler"]
    )


def test_incompatible_checkpoint_fails_on_every_rank(results):
    for rank in results[0]:
        assert "blocks.0.attention.wq.weight" in rank["incompatible"]
        assert "(128, 128)" in rank["incompatible"]
