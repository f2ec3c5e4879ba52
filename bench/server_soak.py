"""Soak test of `temper serve`: concurrent RL clients for minutes, some killed mid-run.

A server a team can leave running: `--clients` tinker SDK clients, each in its own process,
each create a LoRA training model on one tiny served model (`temper init-model`, no hub) and
loop small RL steps until `--minutes` have passed: `save_weights_and_get_sampling_client`,
one `sample` of a `--group-size` group from a random prompt (`--max-tokens` tokens, no stop),
a toy reward (the fraction of sampled tokens equal to the prompt's first) with group-relative
advantages, `forward_backward` ("importance_sampling"), `optim_step` (AdamW). A quarter of the
clients (at least one) are SIGKILLed at a random time in the first half of the run, as a
crashed notebook would die (no close, no more heartbeats), and a fresh client takes each one's
place; the others close their sessions at the end.

The server runs with `--session-timeout-s` (sessions whose heartbeats stop for that long end,
and their ids answer 410); the bench polls `GET /api/v1/sessions/{id}` of every abandoned
session until it answers 404 or 410, then asks for the session's training models and samplers
(as last listed while it lived) to check that they went with it. `--no-expiry` leaves the
flag out (reclaim is then reported as null, without waiting).

Prints one JSON line: the config; SDK calls and errors in all and per client; client-side
latency p50/p99 per SDK call; the HTTP statuses the server logged; the server's RSS (VmRSS of
the server and its helper processes; shared pages count once per process) sampled every
`--rss-every-s` as [seconds, MiB], and its min, max, spread and growth after
`--warmup-fraction` of the run (while the clients run; an abandoned session holds its memory
until it expires, so its replacement's overlap shows in the spread); each abandoned session
with the seconds from its kill to its reclaim (null if never); and the targets (no errors,
RSS within `TARGET_RSS_FLAT_PCT`, every abandoned session reclaimed) next to what was
measured. The server, the clients and the temporary directory (the server log too, unless
`--server-log` copies it out) go at exit, Ctrl-C included.

    OMP_WAIT_POLICY=PASSIVE python bench/server_soak.py [--clients 4] [--minutes 10] \
        [--session-timeout-s 30 | --no-expiry] [--server-arg=--sampler.cpu.processes=2] \
        [--code-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from server_overhead import descendants, free_port

ROUTES = ("save_weights_and_get_sampling_client", "sample", "forward_backward", "optim_step")
TARGET_RSS_FLAT_PCT = 10.0
GONE = (404, 410)


# --- the parent: server, clients, measurements ----------------------------------------------


@dataclass
class Client:
    """One client process and what it reported."""

    slot: int
    generation: int
    process: subprocess.Popen
    stderr_path: Path
    abandon_at: float | None = None
    """Seconds into the run at which it is SIGKILLed (None: runs to the end)."""
    killed_at: float | None = None
    session_id: str | None = None
    model_id: str | None = None
    calls: list[dict] = field(default_factory=list)
    steps: int | None = None

    def read_stdout(self) -> None:
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # anything else the SDK prints
            if event["event"] == "call":
                self.calls.append(event)
            elif event["event"] == "session":
                self.session_id, self.model_id = event["session_id"], event["model_id"]
            elif event["event"] == "done":
                self.steps = event["steps"]


@dataclass
class Abandoned:
    """An abandoned session and what became of it."""

    session_id: str
    model_id: str
    killed_at_s: float
    held_ids: dict[str, list[str]]
    """Its training models and samplers as listed at the kill."""
    reclaimed_s: float | None = None
    status: int | None = None
    detail: str | None = None
    released: dict[str, dict] = field(default_factory=dict)
    """'models' and 'samplers': how many it held, how many answered 404/410 after the reclaim,
    and the first few that did not (id -> status)."""


class Http:
    """Plain requests to the server with the clients' API key (an ended session's ids answer
    410 to their owner only)."""

    def __init__(self, base_url: str, api_key: str) -> None:
        self.base_url, self.api_key = base_url, api_key

    def request(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.base_url}/api/v1{path}",
            data=data,
            headers={"X-API-Key": self.api_key, "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            try:
                return error.code, json.loads(error.read() or b"{}")
            except json.JSONDecodeError:
                return error.code, {}


def server_command(args, *, model_dir: Path, storage: Path, port: int, api_key: str) -> list[str]:
    """The `temper serve` command line; `--server-arg` adds to it."""
    command = [sys.executable, "-m", "temper", "serve", "--model", str(model_dir)]
    command += ["--port", str(port), "--storage", str(storage), "--api-key", api_key]
    if not args.no_expiry:
        command += ["--session-timeout-s", str(args.session_timeout_s)]
    return command + args.server_arg


def launch_server(command: list[str], log_path: Path, *, code_dir: str | None) -> subprocess.Popen:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    if code_dir is not None:  # `python -m` puts the working directory first on sys.path
        env["PYTHONPATH"] = code_dir
    with log_path.open("w") as log_file:
        return subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=code_dir
        )


def wait_for_server(process: subprocess.Popen, log_path: Path, http: Http) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if http.request("/healthz")[0] == 200:
                return
        except OSError:  # not listening yet
            time.sleep(0.2)
    raise RuntimeError(f"server did not start:\n{log_path.read_text()}")


def start_client(spec: dict, *, slot: int, generation: int, root: Path) -> Client:
    stderr_path = root / f"client-{slot}-{generation}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TINKER_TELEMETRY": "0"}
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("soak_client.py")), json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    client = Client(slot, generation, process, stderr_path)
    threading.Thread(target=client.read_stdout, daemon=True).start()
    return client


def rss_mib(pid: int) -> float:
    """VmRSS of `pid` and its live descendants, MiB (0 for a process already gone)."""
    total_kib = 0
    for member in [pid, *descendants(pid)]:
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        total_kib += sum(
            int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")
        )
    return total_kib / 1024


def model_dims(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    names += ("num_key_value_heads", "head_dim", "vocab_size")
    return {name: config[name] for name in names}


def first_ordinary_token(model_dir: Path) -> int:
    """The first id after the tokenizer's special tokens (prompts are made of ordinary ones)."""
    added = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    return max((token["id"] for token in added), default=-1) + 1


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class Soak:
    """The run: starts the clients, kills and replaces the abandoning ones, samples the
    server's RSS and polls the abandoned sessions until they are reclaimed."""

    def __init__(self, args, *, root: Path, server: subprocess.Popen, http: Http, spec: dict):
        self.args, self.root, self.server, self.http, self.spec = args, root, server, http, spec
        self.rng = random.Random(args.seed)
        self.run_s = 60 * args.minutes
        self.clients: list[Client] = []
        self.abandoned: list[Abandoned] = []
        self.rss_mib: list[tuple[float, float]] = []
        self.start = time.monotonic()
        self._next_rss = self._next_poll = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def run(self) -> None:
        self.spec["until"] = time.time() + self.run_s
        num_abandoning = max(1, self.args.clients // 4)
        for slot in range(self.args.clients):
            client = self.start_client(slot, generation=0)
            if slot < num_abandoning:
                client.abandon_at = self.rng.uniform(0.1, 0.5) * self.run_s
        self.wait_until(lambda: self.elapsed() >= self.run_s)
        # The clients finish their last step and close their sessions.
        self.wait_until(
            lambda: all(c.process.poll() is not None for c in self.clients), limit_s=120
        )
        if not self.args.no_expiry:
            last_kill = max(a.killed_at_s for a in self.abandoned) if self.abandoned else 0.0
            reclaim_deadline = last_kill + self.reclaim_wait_s()
            self.wait_until(
                lambda: (
                    all(a.reclaimed_s is not None for a in self.abandoned)
                    or self.elapsed() >= reclaim_deadline
                )
            )
        self.sample_rss()

    def reclaim_wait_s(self) -> float:
        if self.args.reclaim_wait_s is not None:
            return self.args.reclaim_wait_s
        # Twice the timeout, plus a sweep interval should the server check expiry on its sweep.
        return 2 * self.args.session_timeout_s + 60

    def wait_until(self, done, *, limit_s: float = math.inf) -> None:
        give_up = self.elapsed() + limit_s
        while not done() and self.elapsed() < give_up:
            if self.server.poll() is not None:
                raise RuntimeError(f"server exited with {self.server.returncode} mid-run")
            self.tick()
            time.sleep(0.25)

    def tick(self) -> None:
        now = self.elapsed()
        for client in list(self.clients):
            due = client.abandon_at is not None and client.killed_at is None
            running = client.process.poll() is None and client.session_id is not None
            if due and running and now >= client.abandon_at:
                self.abandon(client)
        if now >= self._next_rss:
            self.sample_rss()
            self._next_rss = now + self.args.rss_every_s
        if now >= self._next_poll:
            # A poll that times out (a busy server) is asked again on a later tick.
            with contextlib.suppress(OSError):
                self.poll_abandoned()
            self._next_poll = now + self.args.poll_every_s

    def start_client(self, slot: int, *, generation: int) -> Client:
        spec = {**self.spec, "seed": self.args.seed + 1000 * generation + slot}
        client = start_client(spec, slot=slot, generation=generation, root=self.root)
        self.clients.append(client)
        return client

    def abandon(self, client: Client) -> None:
        """SIGKILL the client as a crashed notebook dies, and start a fresh one in its slot."""
        status, session = self.http.request(f"/sessions/{client.session_id}")
        client.process.kill()
        client.process.wait()
        client.killed_at = self.elapsed()
        held_ids = {
            "models": session.get("training_run_ids", []) if status == 200 else [],
            "samplers": session.get("sampler_ids", []) if status == 200 else [],
        }
        self.abandoned.append(
            Abandoned(client.session_id, client.model_id, client.killed_at, held_ids)
        )
        if self.elapsed() < self.run_s:
            self.start_client(client.slot, generation=client.generation + 1)

    def poll_abandoned(self) -> None:
        for abandoned in self.abandoned:
            if abandoned.reclaimed_s is not None or self.args.no_expiry:
                continue
            status, body = self.http.request(f"/sessions/{abandoned.session_id}")
            if status not in GONE:
                continue
            abandoned.reclaimed_s = self.elapsed() - abandoned.killed_at_s
            abandoned.status, abandoned.detail = status, body.get("detail")
            self.check_released(abandoned)

    def check_released(self, abandoned: Abandoned) -> None:
        """Whether each training model and sampler the session held answers 404/410 too."""
        statuses = {
            "models": {
                model_id: self.http.request("/get_info", {"model_id": model_id})[0]
                for model_id in abandoned.held_ids["models"]
            },
            "samplers": {
                sampler_id: self.http.request(f"/samplers/{sampler_id}")[0]
                for sampler_id in abandoned.held_ids["samplers"]
            },
        }
        for kind, by_id in statuses.items():
            kept = {held_id: status for held_id, status in by_id.items() if status not in GONE}
            abandoned.released[kind] = {
                "held": len(by_id),
                "gone": len(by_id) - len(kept),
                "not_gone": dict(list(kept.items())[:5]),
            }

    def sample_rss(self) -> None:
        self.rss_mib.append((round(self.elapsed(), 1), round(rss_mib(self.server.pid), 1)))

    def stop_clients(self) -> None:
        for client in self.clients:
            if client.process.poll() is None:
                client.process.kill()
                client.process.wait()


def server_statuses(log_path: Path) -> dict:
    """HTTP statuses in the server's request log (the bench's own reclaim polls included),
    and its ERROR lines (a request that failed inside the server)."""
    request_line = re.compile(r"\b(?:GET|POST|PUT|DELETE|PATCH) (\S+) (\d{3}) [\d.]+ms")
    statuses: Counter[str] = Counter()
    server_errors: Counter[str] = Counter()
    num_error_lines = 0
    with log_path.open(errors="replace") as log:
        for line in log:
            match = request_line.search(line)
            if match:
                statuses[match.group(2)] += 1
                if match.group(2).startswith("5"):
                    server_errors[match.group(1)] += 1
            num_error_lines += " ERROR " in line or line.startswith("ERROR")
    return {
        "statuses": dict(sorted(statuses.items())),
        "5xx_by_route": dict(server_errors),
        "error_lines": num_error_lines,
    }


def client_summary(client: Client) -> dict:
    failed = [call for call in client.calls if not call["ok"]]
    # Exited with an error, or still running 120 s after the run ended.
    crashed = client.killed_at is None and client.process.returncode != 0
    summary = {
        "slot": client.slot,
        "generation": client.generation,
        "session_id": client.session_id,
        "requests": len(client.calls),
        "errors": len(failed) + crashed,
        "steps": client.steps,
        "abandoned_at_s": None if client.killed_at is None else round(client.killed_at, 1),
        "exit": client.process.returncode,
    }
    if failed:
        summary["first_error"] = f"{failed[0]['route']}: {failed[0]['error'][:300]}"
    if crashed:
        summary["stderr_tail"] = client.stderr_path.read_text(errors="replace")[-600:]
    return summary


def latency_ms(clients: list[Client]) -> dict:
    by_route: dict[str, list[float]] = {}
    for client in clients:
        for call in client.calls:
            if call["ok"]:
                by_route.setdefault(call["route"], []).append(call["ms"])
    return {
        route: {
            "n": len(values),
            "p50": round(percentile(values, 0.5), 1),
            "p99": round(percentile(values, 0.99), 1),
        }
        for route, values in sorted(by_route.items(), key=lambda item: item[0] not in ROUTES)
    }


def rss_after_warmup(soak: Soak) -> dict:
    """The RSS samples between the warm-up and the end of the run (the clients' load; the
    closes at the end free memory on purpose): min, max, their spread ((max - min) / min,
    held to `TARGET_RSS_FLAT_PCT`) and the growth from the first sample to the last (a leak
    shows there; an abandoned session's memory, held until it expires, shows in the spread
    alone)."""
    start_s = soak.args.warmup_fraction * soak.run_s
    warm = [mib for t, mib in soak.rss_mib if start_s <= t <= soak.run_s]
    if not warm:
        return {"min": None, "max": None, "flat_within_pct": None, "growth_pct": None}
    low, high = min(warm), max(warm)
    return {
        "min": low,
        "max": high,
        "flat_within_pct": round(100 * (high - low) / low, 1),
        "growth_pct": round(100 * (warm[-1] - warm[0]) / warm[0], 1),
    }


def report(soak: Soak, *, config: dict, log_path: Path, load_before: float) -> dict:
    clients = [client_summary(client) for client in soak.clients]
    num_errors = sum(client["errors"] for client in clients)
    rss = rss_after_warmup(soak)
    abandoned = [
        {
            "session_id": a.session_id,
            "model_id": a.model_id,
            "killed_at_s": round(a.killed_at_s, 1),
            "reclaimed_s": None if a.reclaimed_s is None else round(a.reclaimed_s, 1),
            "status": a.status,
            "detail": a.detail,
            "released": a.released,
        }
        for a in soak.abandoned
    ]
    all_reclaimed = bool(abandoned) and all(
        a["reclaimed_s"] is not None
        and all(kind["gone"] == kind["held"] for kind in a["released"].values())
        for a in abandoned
    )
    return {
        "bench": "server_soak",
        "config": config,
        "load_average_before": load_before,
        "load_average": round(os.getloadavg()[0], 2),
        "requests": sum(client["requests"] for client in clients),
        "errors": num_errors,
        "latency_ms": latency_ms(soak.clients),
        "server": server_statuses(log_path),
        "rss_mib": soak.rss_mib,
        "rss_after_warmup_mib": rss,
        "abandoned": abandoned,
        "clients": clients,
        "targets": {
            "errors": 0,
            "rss_flat_within_pct": TARGET_RSS_FLAT_PCT,
            "abandoned_reclaimed": "all",
        },
        "met": {
            "errors": num_errors == 0,
            "rss_flat": rss["flat_within_pct"] is not None
            and rss["flat_within_pct"] <= TARGET_RSS_FLAT_PCT,
            "abandoned_reclaimed": all_reclaimed,
        },
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="concurrent SDK clients")
    parser.add_argument("--minutes", type=float, default=10.0, help="run length (fractions ok)")
    parser.add_argument(
        "--session-timeout-s", type=float, default=30.0, help="the server's --session-timeout-s"
    )
    parser.add_argument(
        "--no-expiry", action="store_true", help="leave --session-timeout-s out (older servers)"
    )
    parser.add_argument(
        "--reclaim-wait-s",
        type=float,
        default=None,
        help="after the run, wait this long past the last kill for reclaims "
        "(default: 2 x session timeout + 60)",
    )
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--model-size", default="tiny", help="temper init-model --size")
    parser.add_argument("--rss-every-s", type=float, default=5.0)
    parser.add_argument("--poll-every-s", type=float, default=1.0, help="reclaim polls")
    parser.add_argument(
        "--warmup-fraction", type=float, default=0.2, help="of the run, left out of RSS flatness"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--code-dir",
        default=None,
        help="run the server from this source tree, e.g. `git archive <rev> | tar -x -C DIR` "
        "(default: the installed temper)",
    )
    parser.add_argument(
        "--server-log", default=None, help="copy the server's log here at exit (it is deleted)"
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `temper serve` argument, repeatable: --server-arg=--log-level=info",
    )
    args = parser.parse_args()
    if args.clients < 1:
        raise ValueError(f"--clients must be >= 1, got {args.clients}")
    if args.minutes <= 0:
        raise ValueError(f"--minutes must be > 0, got {args.minutes}")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below
    load_before = round(os.getloadavg()[0], 2)
    root = Path(tempfile.mkdtemp(prefix="temper-soak-"))
    server = soak = None
    try:
        # Deep enough that the SDK's "org/model/variant" tokenizer heuristic leaves it alone.
        model_dir = root / "models" / f"{args.model_size}-digits"
        init = [sys.executable, "-m", "temper", "init-model", str(model_dir)]
        subprocess.run([*init, "--size", args.model_size], check=True, capture_output=True)
        port, api_key = free_port(), f"tml-soak-{secrets.token_hex(16)}"
        command = server_command(
            args, model_dir=model_dir, storage=root / "storage", port=port, api_key=api_key
        )
        log_path = root / "server.log"
        http = Http(f"http://127.0.0.1:{port}", api_key)
        # Held before it is ready, so that an interrupt while it starts still stops it.
        server = launch_server(command, log_path, code_dir=args.code_dir)
        wait_for_server(server, log_path, http)
        dims = model_dims(model_dir)
        spec = {
            "base_url": http.base_url,
            "api_key": api_key,
            "model": str(model_dir),
            "rank": args.rank,
            "group_size": args.group_size,
            "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens,
            "learning_rate": args.learning_rate,
            "first_token": first_ordinary_token(model_dir),
            "vocab_size": dims["vocab_size"],
        }
        soak = Soak(args, root=root, server=server, http=http, spec=spec)
        soak.run()
        config = {
            **{name: value for name, value in vars(args).items() if name != "server_arg"},
            "session_timeout_s": None if args.no_expiry else args.session_timeout_s,
            "model": {"size": args.model_size, **dims},
            "server_command": ["temper", *command[3:]],
        }
        config["server_command"][config["server_command"].index("--api-key") + 1] = "<key>"
        print(json.dumps(report(soak, config=config, log_path=log_path, load_before=load_before)))
    finally:
        if soak is not None:
            soak.stop_clients()
        if server is not None and server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        if args.server_log is not None and (root / "server.log").exists():
            shutil.copyfile(root / "server.log", args.server_log)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
