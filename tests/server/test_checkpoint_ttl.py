"""Checkpoint TTLs through the SDK: `ttl_seconds` at save, `RestClient.set_checkpoint_ttl_
from_tinker_path`, `expires_at` in both listings (kept on disk, so a restarted server lists
it too), out-of-range TTLs refused naming the field, and the sweep deleting what expired."""

from __future__ import annotations

import datetime
import time

import httpx
import pytest
import tinker

from temper.checkpoint.storage import CheckpointPath, CheckpointStorage
from temper.server.http.users import SERVER
from temper.server.state.catalog import CheckpointCatalog
from tests.server.conftest import API_KEY, start_server

HOUR = 3600


def now() -> datetime.datetime:
    return datetime.datetime.now(tz=datetime.UTC)


def expiry_in(checkpoint) -> float | None:
    """Seconds from now until a listed checkpoint expires (None: never)."""
    if checkpoint.expires_at is None:
        return None
    return (checkpoint.expires_at - now()).total_seconds()


def test_ttls_set_at_save_and_later_are_listed_and_kept_on_disk(server, model_dir):
    service = server.service()
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    state = training.save_state("rolling", ttl_seconds=2 * HOUR).result().path
    weights = training.save_weights_for_sampler("final").result().path
    rest = server.rest()

    listed = {
        c.tinker_path: c for c in rest.list_checkpoints(training.model_id).result().checkpoints
    }
    assert 2 * HOUR - 60 < expiry_in(listed[state]) <= 2 * HOUR
    assert listed[weights].expires_at is None

    rest.set_checkpoint_ttl_from_tinker_path(weights, 24 * HOUR).result()
    rest.set_checkpoint_ttl_from_tinker_path(state, None).result()
    every = {c.tinker_path: c for c in rest.list_user_checkpoints().result().checkpoints}
    assert 24 * HOUR - 60 < expiry_in(every[weights]) <= 24 * HOUR
    assert every[state].expires_at is None

    # What a restarted server reads from the same storage.
    restarted = CheckpointCatalog(CheckpointStorage(server.storage))
    checkpoints = restarted.checkpoints(training.model_id, user=SERVER)
    on_disk = {c.tinker_path: c for c in checkpoints}
    assert on_disk[weights].expires_at == every[weights].expires_at
    assert on_disk[state].expires_at is None
    service.close("success").result()


def test_bad_ttls_are_400_naming_the_field_and_unknown_checkpoints_404(server, model_dir):
    service = server.service()
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    path = training.save_weights_for_sampler("kept").result().path
    rest = server.rest()

    with pytest.raises(tinker.BadRequestError, match=r"ttl_seconds must be in 3600\.\.315360000"):
        rest.set_checkpoint_ttl_from_tinker_path(path, 59).result()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds must be in 3600"):
        training.save_state("short", ttl_seconds=10).result()
    url = f"{server.base_url}/api/v1/training_runs/{training.model_id}/checkpoints"
    response = httpx.put(
        f"{url}/sampler_weights/kept/ttl",
        json={"ttl_seconds": "soon"},
        headers={"X-API-Key": API_KEY},
    )
    assert response.status_code == 400 and "ttl_seconds" in response.json()["detail"]
    with pytest.raises(tinker.NotFoundError, match="no checkpoint at"):
        rest.set_checkpoint_ttl_from_tinker_path(path.replace("kept", "missing"), HOUR).result()
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [c.expires_at for c in listed] == [None]  # nothing was set by the refusals
    # The DELETE route on the same path prefix still deletes.
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(training.model_id).result().checkpoints == []
    service.close("success").result()


def test_the_sweep_deletes_checkpoints_whose_ttl_ran_out(model_dir, tmp_path):
    process = start_server(
        model_dir,
        tmp_path / "storage",
        tmp_path / "server.log",
        "--checkpoint-sweep-seconds",
        "0.2",
    )
    try:
        service = process.service()
        training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
        expiring = training.save_state("expiring", ttl_seconds=HOUR).result().path
        lasting = training.save_state("lasting", ttl_seconds=HOUR).result().path
        # Time passes for one of them: its expiry, as stored, is now in the past.
        catalog = CheckpointCatalog(CheckpointStorage(process.storage))
        past = now() - datetime.timedelta(seconds=1)
        catalog.expiry.set(CheckpointPath.parse(expiring), expires_at=past)

        rest = process.rest()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            paths = [
                c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints
            ]
            if expiring not in paths:
                break
            time.sleep(0.1)
        assert paths == [lasting]
        assert (
            f"checkpoint {expiring} expired (ttl_seconds) and was deleted"
            in process.log.read_text()
        )
        service.close("success").result()
    finally:
        process.stop()
