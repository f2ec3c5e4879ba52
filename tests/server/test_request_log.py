"""The request log: one line per request on the server's stderr with method, route, status,
duration, the ids it named (the future's request id as the SDK sees it), and the error
category of a refusal; `--log-level warning` turns it off."""

from __future__ import annotations

import re
import time

import httpx
import pytest
import tinker
from tinker import types

from tests.server.conftest import API_KEY, start_server


def log_lines(server, pattern: str, *, wait_s: float = 0.0) -> list[str]:
    """The server log's lines matching `pattern`; waits up to `wait_s` for one to appear (a
    request's line is written once its response has gone out, so the client may be first)."""
    deadline = time.monotonic() + wait_s
    while True:
        text = server.log.read_text()
        lines = [line for line in text.splitlines() if re.search(pattern, line)]
        if lines or time.monotonic() >= deadline:
            return lines
        time.sleep(0.05)


def test_each_request_is_one_line_with_its_ids_status_and_duration(server, model_dir):
    service = server.service()
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    headers = {"X-API-Key": API_KEY}
    body = {"model_id": training.model_id, "adam_params": {"learning_rate": 1e-3}}
    future = httpx.post(f"{server.base_url}/api/v1/optim_step", json=body, headers=headers)
    request_id = future.json()["request_id"]
    poll = {"request_id": request_id}
    httpx.post(f"{server.base_url}/api/v1/retrieve_future", json=poll, headers=headers)
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([1, 2])
    sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.NotFoundError):
        server.rest().get_session("sess-nope").result()

    model = re.escape(training.model_id)
    [line] = log_lines(server, rf"POST /api/v1/optim_step 200 [\d.]+ms model={model} ", wait_s=5)
    assert line.endswith(f"request={request_id}") and "temper.server.requests" in line
    retrieve = rf"POST /api/v1/retrieve_future 200 [\d.]+ms request={request_id}$"
    assert log_lines(server, retrieve, wait_s=5)
    sample = r"POST /api/v1/asample 200 [\d.]+ms sampler=samp-\w+ request=req-"
    assert log_lines(server, sample, wait_s=5)
    assert log_lines(
        server,
        r"GET /api/v1/sessions/\{session_id\} 404 [\d.]+ms session=sess-nope "
        r"error=user: unknown session 'sess-nope'",
        wait_s=5,
    )
    service.close("success").result()


def test_log_level_warning_leaves_requests_out(model_dir, tmp_path):
    process = start_server(
        model_dir, tmp_path / "storage", tmp_path / "server.log", "--log-level", "warning"
    )
    try:
        process.rest().list_sessions().result()
        assert not log_lines(process, r"/api/v1/")
    finally:
        process.stop()
