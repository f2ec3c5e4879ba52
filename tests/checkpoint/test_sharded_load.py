"""Sharded loading on gloo ranks: a model built on meta, sharded, then given only its own
shards equals the unsharded whole-model load bitwise (a HF directory in several files, a
named size's random init, LoRA adapters), and each rank reads only its slices of the files.
A Qwen3-MoE directory (one HF tensor per expert) loads the same way into stacked experts
that FSDP splits unevenly (3 experts over 2 ranks) and TP keeps whole.

FSDP, TP and DDP on 2 ranks share one spawn (process start-up dominates on a small machine);
FSDP x TP runs on 4.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors import safe_open

from temper.checkpoint import sharded_load
from temper.checkpoint.gather import full_state_dict
from temper.checkpoint.hf import WEIGHTS_INDEX, empty_pretrained, load_pretrained, save_pretrained
from temper.checkpoint.model_source import ModelSource
from temper.checkpoint.sharded_load import DeferredWeights
from temper.client.service_client import ServiceClient
from temper.distributed.local_shard import local_part
from temper.distributed.parallel_dims import ParallelDims
from temper.models import materialize, qwen3_moe_size, qwen3_size
from temper.models.lora import LoraConfig, apply_lora
from temper.observability.process_memory import MIB, peak_rss_mib, reset_peak_rss, rss_mib
from temper.tokenizer import build_builtin_tokenizer
from temper.trainer import TrainerEngine
from temper.trainer.sharding import Sharding
from tests.distributed.spawn import spawn

DIMS = {
    "fsdp": {"dp_shard": 2},
    "tp": {"dp_shard": 1, "tp": 2},
    "ddp": {"dp_replicate": 2, "dp_shard": 1},
}
LORA = LoraConfig(rank=4, alpha=8.0, seed=3)
CPU = torch.device("cpu")
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def _model_config():
    """Tiny, untied, with attention biases (TP splits them column-wise or keeps them whole);
    the digits vocabulary (29) splits unevenly over 2 ranks."""
    vocab_size = build_builtin_tokenizer("digits").vocab_size
    return dataclasses.replace(
        qwen3_size("tiny", vocab_size=vocab_size),
        num_layers=2,
        tie_embeddings=False,
        attention_bias=True,
    )


def _moe_config():
    """Tiny Qwen3-MoE, untied: a dense layer 0 and a sparse layer 1 whose 3 experts split
    unevenly over 2 FSDP ranks (2 and 1)."""
    vocab_size = build_builtin_tokenizer("digits").vocab_size
    return dataclasses.replace(
        qwen3_moe_size("tiny", vocab_size=vocab_size),
        num_layers=2,
        num_experts=3,
        mlp_only_layers=(0,),
        tie_embeddings=False,
    )


def _save(directory: Path, config) -> Path:
    """A HF model directory of a random `config` split over several safetensors files and an
    index."""
    model = materialize(config, seed=5)
    tokenizer = build_builtin_tokenizer("digits")
    save_pretrained(model, directory, tokenizer=tokenizer, max_shard_bytes=100_000)
    assert len(set(json.loads((directory / WEIGHTS_INDEX).read_text())["weight_map"].values())) > 2
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("hf") / "tiny", _model_config())


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    directory = _save(tmp_path_factory.mktemp("hf") / "tiny_moe", _moe_config())
    weight_map = json.loads((directory / WEIGHTS_INDEX).read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.2.down_proj.weight" in weight_map  # one tensor per expert
    return directory


def _trainer(dims: dict) -> TrainerEngine.Config:
    return TrainerEngine.Config(sharding=Sharding.Config(dims=ParallelDims.Config(**dims)))


def _mismatches(actual: dict, expected: dict) -> list[str]:
    """Keys whose tensors differ (or are missing on one side); empty when bitwise equal."""
    keys = sorted(actual.keys() | expected.keys())
    return [
        key
        for key in keys
        if key not in actual or key not in expected or not torch.equal(actual[key], expected[key])
    ]


class _RecordedReads:
    """Wraps safetensors' `safe_open` in sharded_load: records the bytes of every slice read
    and fails on a whole-tensor read."""

    def __init__(self) -> None:
        self.nbytes: list[int] = []

    def __call__(self, *args, **kwargs):
        return _Handle(safe_open(*args, **kwargs), self.nbytes)


class _Handle:
    def __init__(self, handle, nbytes: list[int]) -> None:
        self.handle, self.nbytes = handle, nbytes

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.handle.__exit__(*exc)

    def get_tensor(self, name: str):
        raise AssertionError(f"read {name} whole")

    def get_slice(self, name: str):
        return _Slice(self.handle.get_slice(name), self.nbytes)


class _Slice:
    def __init__(self, tensor_slice, nbytes: list[int]) -> None:
        self.tensor_slice, self.nbytes = tensor_slice, nbytes

    def __getitem__(self, box):
        tensor = self.tensor_slice[box]
        self.nbytes.append(tensor.numel() * tensor.element_size())
        return tensor


def _from_dir(dims: dict, model_dir: Path, *, lora: LoraConfig | None = None) -> dict:
    """A sharded engine loaded from `model_dir` with each rank's reads recorded."""
    reads = _RecordedReads()
    with mock.patch.object(sharded_load, "safe_open", reads):
        engine = _trainer(dims).build(
            model=empty_pretrained(model_dir, device="meta"),
            lora=lora,
            weights=DeferredWeights(device=CPU, model_dir=model_dir),
        )
    local_bytes = sum(
        local_part(p).numel() * p.element_size()
        for name, p in engine.model.named_parameters()
        if "lora" not in name
    )
    return {
        "weights": full_state_dict(engine.model),
        "read_bytes": sum(reads.nbytes),
        "local_bytes": local_bytes,
    }


def _peak_rss_growth(build) -> tuple[int, int]:
    """(bytes the peak resident set grew by while `build()` ran, bytes of its result's
    parameters held by this rank)."""

    # Blocks of 64 KiB and more get their own mappings, given back when freed: otherwise
    # glibc's adaptive threshold serves them from the heap, whose freed holes stay resident
    # (tens of MB here, varying from run to run) and would blur what is live.
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    reset_peak_rss()
    before = rss_mib()
    engine = build()
    growth = int((peak_rss_mib() - before) * MIB)
    held = sum(local_part(p).numel() * p.element_size() for p in engine.model.parameters())
    return growth, held


def _random_init_memory() -> dict:
    """Peak memory of a sharded random init of a 126 MB model (fp32) on this rank."""
    config = dataclasses.replace(
        _model_config(),
        dim=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        ffn_dim=2048,
        attention_bias=False,
    )
    growth, held = _peak_rss_growth(
        lambda: _trainer(DIMS["fsdp"]).build(
            model=materialize(config, device="meta", init="empty"),
            lora=None,
            weights=DeferredWeights(device=CPU, seed=0),
        )
    )
    whole = config.num_params * 4
    return {"growth": growth, "held": held, "whole": whole}


def _sharded_random_init(dims: dict, config, *, seed: int) -> dict:
    """The full weights of a sharded random init of `config`."""
    engine = _trainer(dims).build(
        model=materialize(config, device="meta", init="empty"),
        lora=None,
        weights=DeferredWeights(device=CPU, seed=seed),
    )
    return full_state_dict(engine.model)


def _moe(rank: int, moe_dir: Path, storage: Path) -> dict:
    """The MoE directory and the MoE random init, on every layout, and a named MoE size
    through `ServiceClient`."""
    expected = load_pretrained(moe_dir).state_dict()
    random_model = materialize(_moe_config(), seed=2)
    results = {"dir": {}, "random": {}}
    for name, dims in DIMS.items():
        loaded = _from_dir(dims, moe_dir)
        loaded["mismatches"] = _mismatches(loaded.pop("weights"), expected)
        results["dir"][name] = loaded
        random = _sharded_random_init(dims, _moe_config(), seed=2)
        results["random"][name] = _mismatches(random, random_model.state_dict())
    service = ServiceClient(storage_dir=storage / f"moe{rank}", trainer=_trainer(DIMS["fsdp"]))
    client = service.create_training_client("qwen3_moe/tiny")
    named = ModelSource.Config(family="qwen3_moe", size="tiny").build().model
    results["random"]["client"] = _mismatches(
        full_state_dict(client.engine.model), named.state_dict()
    )
    return results


def _two_ranks(rank: int, model_dir: Path, moe_dir: Path, storage: Path) -> dict:
    expected = load_pretrained(model_dir).state_dict()
    lora_model = load_pretrained(model_dir)
    apply_lora(lora_model, LORA)
    results = {"dir": {}, "random": {}}
    for name, dims in DIMS.items():
        loaded = _from_dir(dims, model_dir)
        loaded["mismatches"] = _mismatches(loaded.pop("weights"), expected)
        results["dir"][name] = loaded
    lora = _from_dir(DIMS["fsdp"], model_dir, lora=LORA)
    results["dir"]["fsdp_lora"] = _mismatches(lora["weights"], lora_model.state_dict())

    # ServiceClient's named sizes take seed 0.
    random_model = ModelSource.Config(size="tiny").build().model
    random_lora = ModelSource.Config(size="tiny").build().model
    apply_lora(random_lora, LORA)
    for name, dims in DIMS.items():
        service = ServiceClient(storage_dir=storage / f"{name}{rank}", trainer=_trainer(dims))
        client = service.create_training_client("tiny")
        weights = full_state_dict(client.engine.model)
        results["random"][name] = _mismatches(weights, random_model.state_dict())
    service = ServiceClient(storage_dir=storage / f"lora{rank}", trainer=_trainer(DIMS["fsdp"]))
    client = service.create_lora_training_client("tiny", rank=LORA.rank, seed=LORA.seed)
    # The client's LoRA has alpha 32 (Tinker's API takes none); alpha does not change values.
    weights = full_state_dict(client.engine.model)
    results["random"]["fsdp_lora"] = _mismatches(weights, random_lora.state_dict())
    client = service.create_training_client(str(model_dir))
    results["dir"]["client"] = _mismatches(full_state_dict(client.engine.model), expected)
    results["moe"] = _moe(rank, moe_dir, storage)
    # Last: the modules loaded on first use (FSDP, DTensor ops) are in memory already.
    results["memory"] = _random_init_memory()
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, model_dir, moe_dir) -> list[dict]:
    return spawn(
        _two_ranks,
        world_size=2,
        out_dir=tmp_path_factory.mktemp("ranks"),
        args=(model_dir, moe_dir, tmp_path_factory.mktemp("storage")),
    )


def _checkpoint_bytes(model_dir: Path) -> int:
    return json.loads((model_dir / WEIGHTS_INDEX).read_text())["metadata"]["total_size"]


@pytest.mark.parametrize("dims", [*DIMS, "fsdp_lora", "client"])
def test_sharded_load_from_a_directory_equals_load_pretrained_bitwise(two_ranks, dims):
    for rank in two_ranks:
        result = rank["dir"][dims]
        assert (result["mismatches"] if isinstance(result, dict) else result) == []


@pytest.mark.parametrize("dims", [*DIMS, "fsdp_lora"])
def test_sharded_random_init_equals_the_unsharded_init_bitwise(two_ranks, dims):
    for rank in two_ranks:
        assert rank["random"][dims] == []


def test_each_rank_reads_only_its_own_slices(two_ranks, model_dir):
    total = _checkpoint_bytes(model_dir)
    for name in DIMS:
        results = [rank["dir"][name] for rank in two_ranks]
        for result in results:
            # Exactly its shards' bytes, in slices (reading a tensor whole fails the wrapper).
            assert result["read_bytes"] == result["local_bytes"]
        read = [result["read_bytes"] for result in results]
        if name == "fsdp":  # every element read once, half on each rank (29 rows split 15/14)
            assert sum(read) == total
            assert max(read) < 0.52 * total
        elif name == "tp":  # embedding, unembedding and norms are whole on every rank
            assert sum(read) > total and max(read) < 0.75 * total
        else:  # DDP: whole replicas
            assert read == [total, total]


@pytest.mark.parametrize("dims", list(DIMS))
def test_sharded_load_of_a_moe_directory_equals_load_pretrained_bitwise(two_ranks, dims):
    for rank in two_ranks:
        assert rank["moe"]["dir"][dims]["mismatches"] == []


@pytest.mark.parametrize("dims", [*DIMS, "client"])
def test_sharded_random_init_of_a_moe_model_equals_the_unsharded_init_bitwise(two_ranks, dims):
    for rank in two_ranks:
        assert rank["moe"]["random"][dims] == []


def test_each_rank_reads_only_its_own_experts(two_ranks, moe_dir):
    total = _checkpoint_bytes(moe_dir)
    config = _moe_config()
    # One expert's three projections (fp32): FSDP gives rank 0 experts 0 and 1, rank 1 expert 2.
    expert = 3 * config.dim * config.moe_ffn_dim * 4
    fsdp = [rank["moe"]["dir"]["fsdp"] for rank in two_ranks]
    for result in fsdp:
        assert result["read_bytes"] == result["local_bytes"]
    assert sum(result["read_bytes"] for result in fsdp) == total
    # The dense rest splits about evenly; the experts 2 and 1.
    assert fsdp[0]["read_bytes"] - fsdp[1]["read_bytes"] >= expert * 0.9
    tp = [rank["moe"]["dir"]["tp"] for rank in two_ranks]
    for result in tp:
        # Every expert whole on each tp rank, read in slices of exactly its own bytes.
        assert result["read_bytes"] == result["local_bytes"]
        assert result["read_bytes"] > config.num_experts * expert
    assert [rank["moe"]["dir"]["ddp"]["read_bytes"] for rank in two_ranks] == [total, total]


def test_sharded_random_init_peaks_at_about_one_shard_per_rank(two_ranks):
    for rank in two_ranks:
        memory = rank["memory"]
        assert memory["held"] <= 0.51 * memory["whole"]
        # Its shard, one module drawn whole (4 MB here) and a little more: 7 MB beyond the
        # shard when measured; a whole copy would add half the model again.
        assert memory["growth"] < memory["held"] + 0.25 * memory["whole"], memory


def _four_ranks(rank: int, model_dir: Path, moe_dir: Path) -> dict:
    dims = {"dp_shard": 2, "tp": 2}
    loaded = _from_dir(dims, model_dir)
    moe = _from_dir(dims, moe_dir)
    moe_random = _sharded_random_init(dims, _moe_config(), seed=2)
    random_model = ModelSource.Config(size="tiny", seed=4).build().model
    engine = _trainer(dims).build(
        model=materialize(random_model.config, device="meta", init="empty"),
        lora=None,
        weights=DeferredWeights(device=CPU, seed=4),
    )
    return {
        "dir": _mismatches(loaded["weights"], load_pretrained(model_dir).state_dict()),
        "random": _mismatches(full_state_dict(engine.model), random_model.state_dict()),
        "read_bytes": loaded["read_bytes"],
        "local_bytes": loaded["local_bytes"],
        "moe_dir": _mismatches(moe["weights"], load_pretrained(moe_dir).state_dict()),
        "moe_random": _mismatches(moe_random, materialize(_moe_config(), seed=2).state_dict()),
        "moe_read_bytes": moe["read_bytes"],
        "moe_local_bytes": moe["local_bytes"],
    }


def test_fsdp_times_tp_on_four_ranks_loads_bitwise(tmp_path, model_dir, moe_dir):
    results = spawn(_four_ranks, world_size=4, out_dir=tmp_path, args=(model_dir, moe_dir))
    for result in results:
        assert result["dir"] == [] and result["random"] == []
        assert result["read_bytes"] == result["local_bytes"]
        assert result["moe_dir"] == [] and result["moe_random"] == []
        assert result["moe_read_bytes"] == result["moe_local_bytes"]
