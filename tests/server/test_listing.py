"""Listing every training run and every checkpoint in storage (RestClient.list_training_runs,
list_user_checkpoints): most recent first, in pages."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.conftest import API_KEY


def test_runs_and_checkpoints_are_listed_most_recent_first_in_pages(server, model_dir):
    service = server.service()
    first = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    second = service.create_lora_training_client(str(model_dir), rank=8, seed=0).result()
    paths = []
    for training, name in ((first, "a"), (second, "b"), (first, "c")):
        time.sleep(0.05)  # distinct modification times, whatever the clock's granularity
        save = training.save_weights_for_sampler if name != "a" else training.save_state
        paths.append(save(name).result().path)
    rest = server.rest()

    runs = rest.list_training_runs().result()
    assert [run.training_run_id for run in runs.training_runs] == [first.model_id, second.model_id]
    assert (runs.cursor.offset, runs.cursor.limit, runs.cursor.total_count) == (0, 20, 2)
    assert runs.training_runs[0].lora_rank == 4 and runs.training_runs[1].lora_rank == 8
    page = rest.list_training_runs(limit=1, offset=1).result()
    assert [run.training_run_id for run in page.training_runs] == [second.model_id]
    assert page.cursor.total_count == 2

    checkpoints = rest.list_user_checkpoints().result()
    assert [c.tinker_path for c in checkpoints.checkpoints] == paths[::-1]
    assert checkpoints.cursor.total_count == 3
    page = rest.list_user_checkpoints(limit=2, offset=2).result()
    assert [c.tinker_path for c in page.checkpoints] == [paths[0]]
    service.close("success").result()


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/api/v1/training_runs?limit=0", "limit must be in 1..1000, got 0"),
        ("/api/v1/training_runs?offset=-1", "offset must be >= 0, got -1"),
        ("/api/v1/training_runs?project_id=p", "project_id: this server has no projects"),
        ("/api/v1/checkpoints?limit=5000", "limit must be in 1..1000, got 5000"),
    ],
)
def test_bad_pages_are_400_naming_the_parameter(server, path, message):
    response = httpx.get(server.base_url + path, headers={"X-API-Key": API_KEY})
    assert response.status_code == 400
    assert message in response.json()["detail"] and response.json()["category"] == "user"
