"""Train-state checkpoints: bitwise resume, trainable-only, overwrite, crash atomicity, errors."""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
import torch.nn.functional as F

import temper.checkpoint
from temper.checkpoint.dcp import (
    load_train_state,
    read_train_state_metadata,
    save_train_state,
)
from temper.models import llama_size, materialize, qwen3_moe_size, qwen3_size
from temper.models.qwen3_5 import qwen3_5_size
from temper.models.qwen3_5_moe import qwen3_5_moe_size

VOCAB = 31
METADATA = {"step": 3, "policy_version": 3, "lora": {"rank": 4, "alpha": 8.0}, "rng": [1, 2]}


def _model(
    *, seed: int = 0, num_layers: int = 2, vocab_size: int = VOCAB, size=qwen3_size
) -> torch.nn.Module:
    config = size("tiny", vocab_size=vocab_size)
    changes = {"num_layers": num_layers}
    if hasattr(config, "layer_types"):  # a hybrid model: its last layers, both kinds of mixer
        changes["layer_types"] = config.layer_types[-num_layers:]
    return materialize(dataclasses.replace(config, **changes), seed=seed)


def _freeze_all_but_norms(model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith("norm.weight"))


def _adamw(model: torch.nn.Module, *, lr: float = 1e-2) -> torch.optim.AdamW:
    trainable = [param for param in model.parameters() if param.requires_grad]
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=0.1)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        tokens_BT = torch.randint(0, VOCAB, (2, 9), generator=generator)
        logits_BTV = model(tokens_BT[:, :-1])
        loss = F.cross_entropy(logits_BTV.reshape(-1, VOCAB), tokens_BT[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _assert_models_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    b_state = b.state_dict()
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b_state[name]), name


def _assert_optimizers_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    a_state, b_state = a.state_dict(), b.state_dict()
    assert a_state["param_groups"] == b_state["param_groups"]
    assert a_state["state"].keys() == b_state["state"].keys()
    for index, entry in a_state["state"].items():
        assert entry.keys() == b_state["state"][index].keys()
        for name, value in entry.items():
            assert torch.equal(value, b_state["state"][index][name]), (index, name)


def _saved_keys(directory) -> set[str]:
    return set(torch_dcp.FileSystemReader(directory).read_metadata().state_dict_metadata)


@pytest.mark.parametrize(
    "size",
    [qwen3_size, llama_size, qwen3_moe_size, qwen3_5_size, qwen3_5_moe_size],
    ids=["qwen3", "llama", "qwen3_moe", "qwen3_5", "qwen3_5_moe"],
)
def test_resume_from_checkpoint_is_bitwise_equal_to_uninterrupted_training(tmp_path, size):
    reference = _model(size=size)
    reference_optimizer = _adamw(reference)
    _train(reference, reference_optimizer, steps=range(5))

    model = _model(size=size)
    optimizer = _adamw(model)
    _train(model, optimizer, steps=range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning spam from DCP in one process
        path = save_train_state(
            tmp_path / "ckpt",
            model=model,
            optimizer=optimizer,
            metadata=METADATA,
            trainable_only=False,
        )
        resumed = _model(seed=1, size=size)
        resumed_optimizer = _adamw(resumed, lr=0.5)  # the saved lr wins
        metadata = load_train_state(
            path, model=resumed, optimizer=resumed_optimizer, trainable_only=False
        )
    assert metadata == METADATA
    _assert_models_equal(resumed, model)
    _assert_optimizers_equal(resumed_optimizer, optimizer)

    _train(resumed, resumed_optimizer, steps=range(3, 5))
    _assert_models_equal(resumed, reference)
    _assert_optimizers_equal(resumed_optimizer, reference_optimizer)


def test_checkpoint_before_the_first_step_resumes_bitwise(tmp_path):
    reference = _model()
    reference_optimizer = _adamw(reference)
    _train(reference, reference_optimizer, steps=range(2))

    model = _model()
    optimizer = _adamw(model)
    save_train_state(
        tmp_path / "ckpt", model=model, optimizer=optimizer, metadata={}, trainable_only=False
    )
    assert not optimizer.state  # saving took no optimizer step
    resumed = _model(seed=1)
    resumed_optimizer = _adamw(resumed, lr=0.5)
    _train(resumed, resumed_optimizer, steps=range(1))  # state that the checkpoint must clear
    load_train_state(
        tmp_path / "ckpt", model=resumed, optimizer=resumed_optimizer, trainable_only=False
    )
    assert not resumed_optimizer.state

    for trained, trained_optimizer in [(model, optimizer), (resumed, resumed_optimizer)]:
        _train(trained, trained_optimizer, steps=range(2))
        _assert_models_equal(trained, reference)
        _assert_optimizers_equal(trained_optimizer, reference_optimizer)


def test_trainable_only_writes_and_restores_only_trainable_parameters(tmp_path):
    reference = _model()
    _freeze_all_but_norms(reference)
    reference_optimizer = _adamw(reference)
    _train(reference, reference_optimizer, steps=range(4))

    model = _model()
    _freeze_all_but_norms(model)
    optimizer = _adamw(model)
    _train(model, optimizer, steps=range(2))
    save_train_state(
        tmp_path / "ckpt", model=model, optimizer=optimizer, metadata=METADATA, trainable_only=True
    )
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    saved_model_keys = {key for key in _saved_keys(tmp_path / "ckpt") if key.startswith("model.")}
    assert saved_model_keys == {f"model.{name}" for name in trainable}

    resumed = _model()  # the same frozen base, as when a base model is loaded again
    _freeze_all_but_norms(resumed)
    resumed_optimizer = _adamw(resumed)
    load_train_state(
        tmp_path / "ckpt", model=resumed, optimizer=resumed_optimizer, trainable_only=True
    )
    _assert_models_equal(resumed, model)
    _train(resumed, resumed_optimizer, steps=range(2, 4))
    _assert_models_equal(resumed, reference)
    _assert_optimizers_equal(resumed_optimizer, reference_optimizer)

    with pytest.raises(ValueError, match=r"lacks tensors 'model\.embed\.weight'.*trainable_only"):
        load_train_state(tmp_path / "ckpt", model=_model(), optimizer=None, trainable_only=False)


def test_weights_only_load_and_metadata(tmp_path):
    model = _model()
    optimizer = _adamw(model)
    _train(model, optimizer, steps=range(1))
    save_train_state(
        tmp_path / "full",
        model=model,
        optimizer=optimizer,
        metadata=METADATA,
        trainable_only=False,
    )
    assert json.loads((tmp_path / "full" / "metadata.json").read_text()) == METADATA
    assert read_train_state_metadata(tmp_path / "full") == METADATA

    resumed = _model(seed=1)
    assert (
        load_train_state(tmp_path / "full", model=resumed, optimizer=None, trainable_only=False)
        == METADATA
    )
    _assert_models_equal(resumed, model)

    save_train_state(
        tmp_path / "weights", model=model, optimizer=None, metadata={}, trainable_only=False
    )
    assert not any(key.startswith("optim.") for key in _saved_keys(tmp_path / "weights"))
    with pytest.raises(ValueError, match=r"weights.*no optimizer state.*optimizer=None"):
        load_train_state(
            tmp_path / "weights", model=resumed, optimizer=_adamw(resumed), trainable_only=False
        )


def test_overwrite_replaces_a_checkpoint_whole(tmp_path):
    model = _model()
    path = tmp_path / "ckpt"
    save_train_state(path, model=model, optimizer=None, metadata={"step": 1}, trainable_only=False)
    with pytest.raises(FileExistsError, match=str(path)):
        save_train_state(
            path, model=model, optimizer=None, metadata={"step": 2}, trainable_only=False
        )
    assert read_train_state_metadata(path) == {"step": 1}

    with torch.no_grad():
        model.norm.weight.add_(1.0)
    save_train_state(
        path,
        model=model,
        optimizer=None,
        metadata={"step": 2},
        trainable_only=False,
        overwrite=True,
    )
    assert read_train_state_metadata(path) == {"step": 2}
    resumed = _model(seed=1)
    load_train_state(path, model=resumed, optimizer=None, trainable_only=False)
    _assert_models_equal(resumed, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing left aside

    (tmp_path / "empty").mkdir()  # an empty directory is no checkpoint to protect
    save_train_state(
        tmp_path / "empty", model=model, optimizer=None, metadata={}, trainable_only=False
    )


def test_a_crash_mid_save_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    model = _model()
    optimizer = _adamw(model)
    _train(model, optimizer, steps=range(1))
    save_train_state(
        tmp_path / "old",
        model=model,
        optimizer=optimizer,
        metadata={"step": 1},
        trainable_only=False,
    )
    real_save = torch_dcp.save

    def save_then_crash(*args, **kwargs):
        real_save(*args, **kwargs)  # the tensor files are written; then the process dies
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch_dcp, "save", save_then_crash)
    for name, overwrite in [("new", False), ("old", True)]:
        with pytest.raises(RuntimeError, match="disk full"):
            save_train_state(
                tmp_path / name,
                model=model,
                optimizer=optimizer,
                metadata={"step": 2},
                trainable_only=False,
                overwrite=overwrite,
            )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    assert read_train_state_metadata(tmp_path / "old") == {"step": 1}
    load_train_state(tmp_path / "old", model=_model(seed=1), optimizer=None, trainable_only=False)

    with pytest.raises(TypeError, match="metadata must be JSON-serializable"):
        save_train_state(
            tmp_path / "bad",
            model=model,
            optimizer=None,
            metadata={"rng": torch.zeros(2)},
            trainable_only=False,
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_missing_checkpoint_is_a_file_not_found_error(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_train_state(missing, model=_model(), optimizer=None, trainable_only=False)
    with pytest.raises(FileNotFoundError, match=str(missing)):
        read_train_state_metadata(missing)
    (tmp_path / "plain").mkdir()
    with pytest.raises(FileNotFoundError, match=r"plain is not a train-state checkpoint"):
        read_train_state_metadata(tmp_path / "plain")


def test_mismatched_checkpoint_is_a_value_error_and_changes_nothing(tmp_path):
    model = _model()
    optimizer = _adamw(model)
    _train(model, optimizer, steps=range(1))
    save_train_state(
        tmp_path / "ckpt", model=model, optimizer=optimizer, metadata={}, trainable_only=False
    )

    wider_vocab = _model(vocab_size=37)
    with pytest.raises(
        ValueError, match=r"'model\.embed\.weight' has shape \(31, 128\).*\(37, 128\)"
    ):
        load_train_state(tmp_path / "ckpt", model=wider_vocab, optimizer=None, trainable_only=False)

    deeper = _model(num_layers=3, seed=1)
    deeper_optimizer = _adamw(deeper)
    before = {name: tensor.clone() for name, tensor in deeper.state_dict().items()}
    with pytest.raises(ValueError, match=r"lacks tensors 'model\.blocks\.2\."):
        load_train_state(
            tmp_path / "ckpt", model=deeper, optimizer=deeper_optimizer, trainable_only=False
        )
    for name, tensor in deeper.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert not deeper_optimizer.state

    # An optimizer over more parameters than the saved one: their state is not in the checkpoint.
    full = _model(seed=1)
    partial = _model()
    _freeze_all_but_norms(partial)
    partial_optimizer = _adamw(partial)
    _train(partial, partial_optimizer, steps=range(1))
    save_train_state(
        tmp_path / "partial",
        model=partial,
        optimizer=partial_optimizer,
        metadata={},
        trainable_only=False,
    )
    with pytest.raises(ValueError, match=r"lacks tensors 'optim\.state\.embed\.weight\."):
        load_train_state(
            tmp_path / "partial", model=full, optimizer=_adamw(full), trainable_only=False
        )


def test_a_cut_short_or_missing_shard_file_fails_before_anything_is_loaded(tmp_path):
    source = _model()
    optimizer = _adamw(source)
    _train(source, optimizer, steps=range(1))
    save_train_state(
        tmp_path / "ckpt", model=source, optimizer=optimizer, metadata={}, trainable_only=False
    )
    (shard,) = (tmp_path / "ckpt").glob("*.distcp")
    target = _model(seed=1)
    target_optimizer = _adamw(target)
    _train(target, target_optimizer, steps=range(1, 2))
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    moments = {k: v.clone() for k, v in target_optimizer.state_dict()["state"][0].items()}

    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # a copy interrupted half way
    with pytest.raises(ValueError, match=rf"{shard.name} has {len(data) // 2} bytes, its index"):
        load_train_state(
            tmp_path / "ckpt", model=target, optimizer=target_optimizer, trainable_only=False
        )
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"incomplete: {shard.name} is missing"):
        load_train_state(
            tmp_path / "ckpt", model=target, optimizer=target_optimizer, trainable_only=False
        )
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    for key, value in target_optimizer.state_dict()["state"][0].items():
        assert torch.equal(value, moments[key]), key


def test_public_api():
    assert {"save_train_state", "load_train_state", "read_train_state_metadata"} <= set(
        temper.checkpoint.__all__
    )
    assert list(inspect.signature(save_train_state).parameters) == [
        "directory",
        "model",
        "optimizer",
        "metadata",
        "trainable_only",
        "overwrite",
    ]
    assert list(inspect.signature(load_train_state).parameters) == [
        "directory",
        "model",
        "optimizer",
        "trainable_only",
    ]
