"""`/healthz` latency while one client sends `temper serve` a huge bad request.

Starts a server on a tiny model (subprocess, free port), then for each bad request below polls
`GET /api/v1/healthz` every 10 ms from another process while the bad request runs, and reports
the bad request's status, seconds and answer size, and the health checks' median and max
latency in milliseconds (bodies are built before the clock starts; compact JSON):
- `tags_1m`: create_session with 1,000,000 tags that are not strings (2 MB);
- `tags_500k`: the same with 500,000 (1 MB, just under the 1 MiB limit of non-data routes);
- `tags_9k`: the same with 9,000 (under the 10,000 JSON items of non-data routes);
- `stop_300k`: asample with 300,000 stop strings (1.5 MB);
- `asample_bad_tokens_1m`: asample with a prompt of 1,000,000 tokens that are not ints (4 MB);
- `fwdbwd_malformed`: a forward_backward protobuf of `--fwdbwd-mb` MB of small datums with
  invalid bytes at the end, so the whole body parses before it fails;
- `fwdbwd_garbage`: the same number of random bytes (fails at once).
Prints one JSON line. Temporary directories are removed at exit.

    python bench/server_bounds.py [--fwdbwd-mb 250]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from server_overhead import start_server

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["TINKER_TELEMETRY"] = "0"


def poll_health(base_url: str, stop, latencies_ms) -> None:
    """In its own process (so the sender's GIL cannot delay it): healthz every 10 ms."""
    import httpx

    with httpx.Client(base_url=base_url, timeout=120) as client:
        while not stop.is_set():
            started = time.perf_counter()
            assert client.get("/api/v1/healthz").status_code == 200
            latencies_ms.append((time.perf_counter() - started) * 1e3)
            time.sleep(0.01)


def during(base_url: str, send) -> dict[str, float | int]:
    """Run `send()` (returns an httpx.Response) while polling healthz; their figures."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        stop, latencies_ms = manager.Event(), manager.list()
        poller = context.Process(target=poll_health, args=(base_url, stop, latencies_ms))
        poller.start()
        while not latencies_ms:
            time.sleep(0.01)
        started = time.perf_counter()
        response = send()
        seconds = time.perf_counter() - started
        time.sleep(0.1)
        stop.set()
        poller.join()
        latencies = list(latencies_ms)
    return {
        "status": response.status_code,
        "seconds": round(seconds, 3),
        "answer_bytes": len(response.content),
        "healthz_median_ms": round(statistics.median(latencies), 1),
        "healthz_max_ms": round(max(latencies), 1),
    }


def malformed_fwdbwd(num_bytes: int) -> bytes:
    from tinker.proto import tinker_public_pb2 as pb

    head = pb.ForwardBackwardRequest(model_id="x", loss_fn="cross_entropy").SerializeToString()
    only_data = pb.ForwardBackwardRequest()
    only_data.data.add().model_input.add().encoded_text.tokens = bytes(64)
    datum = only_data.SerializeToString()  # one `data` field; repeating it appends datums
    body = head + datum * ((num_bytes - len(head)) // len(datum))
    return body + b"\xff\xff\xff"  # an invalid tag: fails once everything before it parsed


def bad_requests(client, *, sampler: str, fwdbwd_bytes: int) -> dict[str, object]:
    """name -> a function that sends that bad request (bodies built beforehand)."""

    def post_json(route: str, body: dict) -> object:
        content = json.dumps(body, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json"}
        return lambda: client.post(route, content=content, headers=headers)

    def tags(num_tags: int) -> object:
        body = {"tags": [0] * num_tags, "user_metadata": None, "sdk_version": "bench"}
        return post_json("/create_session", body)

    def sample(tokens: list, stop: list | None = None) -> object:
        return post_json(
            "/asample",
            {
                "sampling_session_id": sampler,
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                "sampling_params": {"max_tokens": 1, "stop": stop},
            },
        )

    protobuf = {"Content-Type": "application/x-protobuf"}
    malformed, garbage = malformed_fwdbwd(fwdbwd_bytes), os.urandom(fwdbwd_bytes)
    return {
        "tags_1m": tags(1_000_000),
        "tags_500k": tags(500_000),
        "tags_9k": tags(9_000),
        "stop_300k": sample([1, 2], ["ab"] * 300_000),
        "asample_bad_tokens_1m": sample(["a"] * 1_000_000),
        "fwdbwd_malformed": lambda: client.post(
            "/forward_backward", content=malformed, headers=protobuf
        ),
        "fwdbwd_garbage": lambda: client.post(
            "/forward_backward", content=garbage, headers=protobuf
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fwdbwd-mb", type=float, default=250.0)
    args = parser.parse_args()

    import httpx

    from temper.checkpoint.model_source import init_model_dir

    root = Path(tempfile.mkdtemp(prefix="temper-bounds-"))
    try:
        model_dir = root / "models" / "tiny-digits"
        init_model_dir(model_dir, size="tiny", tokenizer="digits", seed=0)
        process, base_url = start_server(model_dir, root / "storage")
        try:
            client = httpx.Client(base_url=f"{base_url}/api/v1", timeout=600)
            empty = {"tags": [], "user_metadata": None, "sdk_version": "bench"}
            session = client.post("/create_session", json=empty).json()["session_id"]
            sampler = client.post(
                "/create_sampling_session",
                json={
                    "session_id": session,
                    "sampling_session_seq_id": 0,
                    "base_model": str(model_dir),
                },
            ).json()["sampling_session_id"]
            requests = bad_requests(client, sampler=sampler, fwdbwd_bytes=int(args.fwdbwd_mb * 1e6))
            results = {name: during(base_url, send) for name, send in requests.items()}
            print(json.dumps(results))
        finally:
            process.terminate()
            process.wait(timeout=30)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
