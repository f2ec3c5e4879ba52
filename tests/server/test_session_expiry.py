"""Sessions whose client goes away without closing (a crashed notebook, a killed job) expire.

A client in a subprocess trains, snapshots and samples on `temper serve
--session-timeout-s 15`, then is SIGKILLed mid-run. Within the timeout + 10 s its session is
reclaimed: its ids answer 410 saying it expired and why, its checkpoints stay, and the
server's memory comes back (RSS within a margin of what it was before the session). A live
client idle for longer than the timeout stays (the SDK's heartbeats keep it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
from tinker import types

from temper.observability.process_memory import rss_mib
from tests.server.conftest import API_KEY, start_server

TIMEOUT_S = 15

ABANDONED = textwrap.dedent(
    """
    import json, sys, time
    import tinker
    from tinker import types
    service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
    training = service.create_lora_training_client(sys.argv[3], rank=4, seed=0).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6, 7, 8, 9], "weights": [1.0] * 8},
    )
    for _ in range(3):
        training.forward_backward([datum] * 4, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = training.save_state("kept").result().path
    sampler = training.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    sampler.sample(prompt, 8, types.SamplingParams(max_tokens=16, seed=0)).result()
    training.forward_backward([datum] * 4, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()  # the snapshot copies
    print(json.dumps({"model_id": training.model_id, "checkpoint": path}), flush=True)
    time.sleep(3600)
    """
)


def get(server, path: str) -> httpx.Response:
    return httpx.get(f"{server.base_url}/api/v1/{path}", headers={"X-API-Key": API_KEY}, timeout=30)


def post(server, path: str, **kwargs) -> httpx.Response:
    url = f"{server.base_url}/api/v1/{path}"
    return httpx.post(url, headers={"X-API-Key": API_KEY}, timeout=30, **kwargs)


def test_an_abandoned_session_expires_and_its_memory_returns(model_dir, tmp_path):
    server = start_server(
        model_dir,
        tmp_path / "storage",
        tmp_path / "server.log",
        "--api-key",
        API_KEY,
        "--session-timeout-s",
        str(TIMEOUT_S),
    )
    try:
        # A live client loads the base model and a sampler first, and stays.
        live = server.service()
        live_training = live.create_lora_training_client(str(model_dir), rank=4, seed=1).result()
        live_sampler = live_training.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=4, seed=0)
        live_sampler.sample(types.ModelInput.from_ints([1, 2]), 1, params).result()
        pid = server.process.pid
        before = rss_mib(pid)

        client = subprocess.Popen(
            [sys.executable, "-c", ABANDONED, server.base_url, API_KEY, str(model_dir)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "TINKER_TELEMETRY": "0"},
        )
        abandoned = json.loads(client.stdout.readline())
        during = rss_mib(pid)
        client.send_signal(signal.SIGKILL)
        client.wait()
        killed_at = time.monotonic()
        model_id = abandoned["model_id"]
        session_id = model_id.split(":")[0]

        while get(server, f"sessions/{session_id}").status_code == 200:
            assert time.monotonic() - killed_at < TIMEOUT_S + 10, "the session was not reclaimed"
            time.sleep(0.5)
        gone = get(server, f"sessions/{session_id}")
        assert gone.status_code == 410, gone.text
        assert "expired: no heartbeat for" in gone.json()["detail"]
        assert "--session-timeout-s 15" in gone.json()["detail"]
        info = post(server, "get_info", json={"model_id": model_id})
        assert info.status_code == 410 and "expired" in info.json()["detail"]

        # Its checkpoint stays; the live client (idle past the timeout but heartbeating) too.
        assert (server.storage / model_id / "weights" / "kept").is_dir()
        time.sleep(2)  # let the release settle
        after = rss_mib(pid)
        print(
            f"server RSS: before {before:.0f} MiB, with the session {during:.0f}, after {after:.0f}"
        )
        grown = during - before
        # Its adapters, optimizer state, snapshot copy and KV cache: ~20 MiB on the tiny model.
        assert grown > 10, f"the abandoned session should hold memory (grew {grown:.0f} MiB)"
        assert after - before < 15, (before, during, after)
        assert live_training.get_info().model_id == live_training.model_id
        live_sampler.sample(types.ModelInput.from_ints([1, 2]), 1, params).result()
        live.close("success").result()
    finally:
        server.stop()
