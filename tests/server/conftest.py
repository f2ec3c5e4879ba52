"""A real `temper serve` subprocess on a free port, driven by the unmodified tinker SDK."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
tinker = pytest.importorskip("tinker")

# The SDK and transformers must never reach the network from tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["TINKER_TELEMETRY"] = "0"

API_KEY = "tml-test-key-0123"


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str
    storage: Path
    log: Path

    def service(self, api_key: str = API_KEY):
        return tinker.ServiceClient(base_url=self.base_url, api_key=api_key)

    def rest(self, api_key: str = API_KEY):
        return tinker.RestClient(base_url=self.base_url, api_key=api_key)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=30)  # ranks stop in turn; slow on a busy machine
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    model_dir: Path, storage: Path, log: Path, *extra: str, host: str = "127.0.0.1"
) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-m", "temper", "serve", "--model", str(model_dir)]
    command += ["--host", host, "--port", str(port), "--storage", str(storage), *extra]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, f"http://127.0.0.1:{port}", storage, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return server
        except OSError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"server did not start:\n{log.read_text()}")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from temper.checkpoint.model_source import init_model_dir

    # Deep enough that the SDK's "org/model/variant" tokenizer heuristic leaves it alone.
    directory = tmp_path_factory.mktemp("models") / "tiny-digits"
    init_model_dir(directory, size="tiny", tokenizer="digits", seed=0)
    return directory


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("server")
    process = start_server(model_dir, root / "storage", root / "server.log")
    yield process
    process.stop()
