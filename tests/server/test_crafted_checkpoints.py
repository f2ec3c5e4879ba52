"""The server reads checkpoints under --storage without running code from them: a crafted
train state is refused by name through the SDK (the model it would load into unchanged), and
what killed saves left in the storage is cleared when the server starts."""

from __future__ import annotations

import os
import time

import pytest
from tinker import types

from temper.checkpoint.storage import CheckpointPath, CheckpointStorage
from tests.checkpoint.crafted import plant_index
from tests.server.conftest import start_server
from tests.server.test_sdk import datum


def test_a_crafted_train_state_is_refused_and_killed_saves_are_cleared(model_dir, tmp_path):
    storage = tmp_path / "storage"
    server = start_server(model_dir, storage, tmp_path / "server.log")
    try:
        service = server.service()
        training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
        data = [datum(training.get_tokenizer(), "12=3")]
        training.forward_backward(data, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state = training.save_state("planted").result().path
        loss = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        directory = CheckpointStorage(storage).directory(CheckpointPath.parse(state))
        marker = tmp_path / "ran"
        plant_index(directory, marker=marker)

        with pytest.raises(Exception, match="is refused") as refused:
            service.create_training_client_from_state_with_optimizer(state).result()
        assert "posix.system" in str(refused.value)
        with pytest.raises(Exception, match="is refused"):
            training.load_state(state).result()
        assert not marker.exists()
        assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] == loss
        service.close("success").result()
    finally:
        server.stop()

    weights = directory.parent
    stale, young = weights / ".step-1.tmp-stale", weights / ".step-2.tmp-young"
    stale.mkdir()
    young.mkdir()
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    server = start_server(model_dir, storage, tmp_path / "second.log")
    try:
        server.rest().get_server_capabilities().result()
        assert not stale.exists()
        assert young.is_dir()  # may be another server's save in progress
    finally:
        server.stop()
