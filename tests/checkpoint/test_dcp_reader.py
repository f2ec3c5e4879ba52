"""No code runs from a checkpoint's files: the checkpoint API and the in-process clients refuse
a crafted one (tests/rl/test_crafted_checkpoints.py: `temper train --resume` and `temper
sample`; tests/server/test_crafted_checkpoints.py: the server). Real checkpoints, also those
written by plain DCP, load unchanged; what a kill during a save leaves is cleared."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from temper import AdamParams, ServiceClient
from temper.checkpoint.atomic import clear_interrupted
from temper.checkpoint.dcp import (
    DCP_METADATA_FILE,
    METADATA_FILE,
    load_train_state,
    save_train_state,
)
from temper.checkpoint.dcp_reader import UnsafeCheckpoint, read_dcp_index
from tests.checkpoint.crafted import plant_index, write_with_planted_value
from tests.checkpoint.test_dcp import _adamw, _assert_models_equal, _model, _train
from tests.client.test_training_client import _data
from tests.client.test_training_client import _train as _train_client


def _trained(tmp_path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, Path]:
    model = _model()
    optimizer = _adamw(model)
    _train(model, optimizer, steps=range(2))
    path = save_train_state(
        tmp_path / "ckpt", model=model, optimizer=optimizer, metadata={}, trainable_only=False
    )
    return model, optimizer, path


def _untouched_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_a_crafted_index_is_refused_before_anything_runs(tmp_path):
    _, _, path = _trained(tmp_path)
    marker = tmp_path / "ran"
    plant_index(path, marker=marker)
    target = _model(seed=1)
    before = _untouched_copy(target)
    with pytest.raises(UnsafeCheckpoint, match=rf"checkpoint {path} is refused.*posix\.system"):
        load_train_state(path, model=target, optimizer=None, trainable_only=False)
    assert not marker.exists()
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_a_crafted_value_is_refused_and_the_model_keeps_its_weights(tmp_path):
    model, optimizer, _ = _trained(tmp_path)
    marker = tmp_path / "ran"
    crafted = tmp_path / "crafted"
    write_with_planted_value(crafted, model=model, optimizer=optimizer, metadata={}, marker=marker)
    target = _model(seed=1)
    target_optimizer = _adamw(target, lr=0.5)
    with pytest.raises(UnsafeCheckpoint, match=r"'optim.param_groups.0.lr' is refused"):
        load_train_state(crafted, model=target, optimizer=target_optimizer, trainable_only=False)
    assert not marker.exists()
    assert target_optimizer.param_groups[0]["lr"] == 0.5


def test_an_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    _, _, path = _trained(tmp_path)
    index = read_dcp_index(path / DCP_METADATA_FILE)
    entry = next(iter(index.storage_data.values()))
    entry.relative_path = "../../etc/passwd"
    (path / DCP_METADATA_FILE).write_bytes(pickle.dumps(index))
    with pytest.raises(UnsafeCheckpoint, match=r"names the file '../../etc/passwd'"):
        load_train_state(path, model=_model(), optimizer=None, trainable_only=False)


def test_garbage_in_the_index_is_a_damaged_checkpoint(tmp_path):
    _, _, path = _trained(tmp_path)
    (path / DCP_METADATA_FILE).write_bytes(b"\x80\x05not a pickle")
    with pytest.raises(ValueError, match=rf"checkpoint {path} is damaged: its .metadata"):
        load_train_state(path, model=_model(), optimizer=None, trainable_only=False)


def test_a_checkpoint_written_by_plain_dcp_loads_bitwise(tmp_path):
    """The restricted reader takes what DCP itself writes, optimizer values included."""
    model, optimizer, _ = _trained(tmp_path)
    plain = tmp_path / "plain"
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's 'assuming a single process'
        torch_dcp.save(state, storage_writer=torch_dcp.FileSystemWriter(plain), no_dist=True)
    (plain / METADATA_FILE).write_text(json.dumps({"step": 2}))
    target = _model(seed=1)
    target_optimizer = _adamw(target, lr=0.5)
    assert load_train_state(
        plain, model=target, optimizer=target_optimizer, trainable_only=False
    ) == {"step": 2}
    _assert_models_equal(target, model)
    assert target_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_in_process_clients_refuse_a_crafted_checkpoint(tmp_path):
    service = ServiceClient(storage_dir=tmp_path / "storage")
    client = service.create_training_client("tiny")
    _train_client(client, _data(client.get_tokenizer()), 1)
    path = client.save_state("w").result().path
    _, directory = service.storage.existing(path)
    marker = tmp_path / "ran"
    plant_index(directory, marker=marker)
    weights = [param.detach().clone() for param in client.engine.trainable]
    with pytest.raises(UnsafeCheckpoint, match=rf"checkpoint {directory} is refused"):
        service.create_training_client_from_state(path)
    with pytest.raises(UnsafeCheckpoint, match=rf"checkpoint {directory} is refused"):
        client.load_state_with_optimizer(path).result()
    assert not marker.exists()
    assert all(torch.equal(a, b) for a, b in zip(weights, client.engine.trainable, strict=True))
    client.optim_step(AdamParams(learning_rate=1e-2)).result()  # the client still works


def test_clear_interrupted_removes_staging_and_puts_a_moved_aside_target_back(tmp_path):
    (tmp_path / ".step-1.tmp-abc").mkdir()
    (tmp_path / ".run_state.old-x").mkdir()
    (tmp_path / ".run_state.old-x" / "state.json").write_text("{}")
    (tmp_path / "kept").mkdir()
    (tmp_path / ".kept.old-y").mkdir()  # the new one arrived: the old copy goes
    (tmp_path / ".hidden").mkdir()
    handled = clear_interrupted(tmp_path)
    assert len(handled) == 3
    assert sorted(path.name for path in tmp_path.iterdir()) == [".hidden", "kept", "run_state"]
    assert (tmp_path / "run_state" / "state.json").read_text() == "{}"


def test_clear_interrupted_leaves_a_young_staging_directory_alone(tmp_path):
    (tmp_path / ".step-1.tmp-abc").mkdir()
    assert clear_interrupted(tmp_path, older_than_s=600) == []
    assert (tmp_path / ".step-1.tmp-abc").is_dir()
