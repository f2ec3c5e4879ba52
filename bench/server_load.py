"""Load test of `temper serve` with official-SDK clients, and a generator rank killed under load.

The bench makes two tiny models (`temper init-model`: the served one and, unless
`--no-second-model`, a second base served with `--sample-only-model`), starts `temper serve`
on a free loopback port with `--server-args` added (so one bench runs against one process,
`--nproc 2`, or a disaggregated `--nproc 3 --placement.mode disaggregated
--placement.generator_ranks 2`), then `--clients` tinker SDK clients, each a process of its
own (bench/load_client.py), cycling through the roles rl, lora_sampler, base_sampler, rl:
RL loops (snapshot, sample a group, forward_backward "importance_sampling", optim_step),
samplers on LoRA adapters of their own (mixed adapters), and samplers (and compute_logprobs)
on the second base model. Once every client is set up, all run for `--seconds`; every SDK call
has a deadline (`--deadline-s`), a retryable failure is tried again (`--retries`), and a
monitor asks `GET /api/v1/healthz` every `--healthz-every-s`.

`--kill-generator-after S` SIGKILLs one generator rank S seconds into the run: its pid comes
from healthz's `ranks` list (`[{"rank", "role", "pid", "alive"}]`, which a multi-rank server
answers with); a server without it, or without a live generator, cannot take the fault, and
the bench says so and exits 2 before the run. The figures are then given before and after
the kill, with the calls in flight at the kill and how each ended.

Prints one JSON line: the server's command line and the workload; per phase and SDK verb
calls/s, sampled tokens/s, p50/p99 latency; failed attempts by kind, calls failed for good,
calls past their deadline; health probes answered; the HTTP statuses the server logged; and
the checks. The server (its whole process tree), the clients and the temporary directory go
at exit, Ctrl-C and errors included.

    OMP_WAIT_POLICY=PASSIVE python bench/server_load.py [--clients 8] [--seconds 30] \
        [--server-args "--nproc 2"] [--no-second-model] [--kill-generator-after 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from load_report import calls_of, checks, healthz_figures, held_at_kill, phase_figures
from server_overhead import descendants, free_port
from server_soak import first_ordinary_token, model_dims, server_statuses

ROLES = ("rl", "lora_sampler", "base_sampler", "rl")
"""Client i takes ROLES[i % 4] (lora_sampler in place of base_sampler without a second model)."""
CANNOT_INJECT = 2
"""Exit code when --kill-generator-after is asked of a server that reports no generator ranks."""


class CannotInjectFault(Exception):
    """The server reports no live generator rank to kill."""


# --- the server ---------------------------------------------------------------------------


def get_json(url: str, *, timeout_s: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read() or b"{}")


class Server:
    """`temper serve` in a session of its own; `stop` ends it and every process under it
    (`--nproc` puts torchrun in a session of its own too, so its pids are gathered while the
    server runs)."""

    def __init__(self, command: list[str], *, log_path: Path) -> None:
        self.command, self.log_path = command, log_path
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        with log_path.open("w") as log_file:
            self.process = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches the bench only
            )
        self.tree: set[int] = set()

    def wait_ready(self, url: str, *, limit_s: float = 180.0) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.process.returncode}:\n{self.log_path.read_text()}"
                )
            try:
                get_json(url, timeout_s=2)
                self.note_tree()
                return
            except OSError:  # not listening yet
                time.sleep(0.3)
        raise RuntimeError(f"server did not start:\n{self.log_path.read_text()}")

    def note_tree(self) -> None:
        self.tree.update(descendants(self.process.pid))

    def stop(self) -> None:
        """SIGTERM (every rank stops cleanly), then SIGKILL whatever of the tree is left."""
        if self.process.poll() is None:
            self.note_tree()
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid in {*self.tree, *descendants(self.process.pid)}:
            with contextlib.suppress(OSError):  # already gone
                # A pid the system gave to another program since is left alone.
                if b"temper" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


# --- the clients --------------------------------------------------------------------------


@dataclass
class Client:
    """One client process and what it reported."""

    index: int
    role: str
    process: subprocess.Popen
    stderr_path: Path
    events: list[dict] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    done: dict | None = None

    def read_stdout(self) -> None:
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # anything else the SDK prints
            if event["event"] == "call":
                self.events.append(event)
            elif event["event"] == "ready":
                self.ready.set()
            elif event["event"] == "done":
                self.done = event
                self.ready.set()  # a client whose setup failed is waited for no longer

    def send(self, line: str) -> None:
        self.process.stdin.write(f"{line}\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_client(index: int, spec: dict, *, root: Path) -> Client:
    stderr_path = root / f"client-{index}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("load_client.py")), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            start_new_session=True,
        )
    client = Client(index, spec["role"], process, stderr_path)
    threading.Thread(target=client.read_stdout, daemon=True).start()
    return client


def client_roles(num_clients: int, *, second_model: bool) -> list[str]:
    roles = [ROLES[index % len(ROLES)] for index in range(num_clients)]
    return [r if second_model or r != "base_sampler" else "lora_sampler" for r in roles]


# --- the run ------------------------------------------------------------------------------


class HealthMonitor:
    """Asks healthz every `every_s` from a thread: (epoch second, answered, ms) per probe."""

    def __init__(self, url: str, *, every_s: float, timeout_s: float) -> None:
        self.url, self.every_s, self.timeout_s = url, every_s, timeout_s
        self.polls: list[tuple[float, bool, float]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            start = time.time()
            try:
                get_json(self.url, timeout_s=self.timeout_s)
                answered = True
            except (OSError, ValueError):
                answered = False
            self.polls.append((start, answered, 1000 * (time.time() - start)))

    def between(self, start: float, end: float) -> list[tuple[float, bool, float]]:
        return [poll for poll in self.polls if start <= poll[0] < end]


def live_generator(healthz: dict) -> dict:
    """The live generator rank with the highest rank number, from healthz's `ranks`."""
    ranks = healthz.get("ranks")
    if not isinstance(ranks, list):
        raise CannotInjectFault(
            "--kill-generator-after: the server's GET /api/v1/healthz has no 'ranks' list "
            f"(it answered {json.dumps(healthz)}); only a server with generator ranks "
            "(--nproc N --placement.mode disaggregated) reports them"
        )
    generators = [r for r in ranks if r.get("role") == "generator" and r.get("alive")]
    if not generators:
        raise CannotInjectFault(
            f"--kill-generator-after: no live generator rank in healthz's ranks {ranks}"
        )
    return max(generators, key=lambda r: r["rank"])


def kill_generator(healthz_url: str) -> dict:
    rank = live_generator(get_json(healthz_url, timeout_s=10))
    os.kill(rank["pid"], signal.SIGKILL)
    return {"rank": rank["rank"], "pid": rank["pid"], "at": time.time()}


def reported_dead_after(healthz_url: str, kill: dict, *, limit_s: float) -> float | None:
    """Seconds from the kill until healthz lists the rank as not alive (None: not by limit_s)."""
    while time.time() < kill["at"] + limit_s:
        try:
            ranks = get_json(healthz_url, timeout_s=5).get("ranks", [])
        except (OSError, ValueError):
            ranks = []
        if any(r["rank"] == kill["rank"] and not r.get("alive") for r in ranks):
            return round(time.time() - kill["at"], 2)
        time.sleep(0.5)
    return None


def run(args, *, clients: list[Client], server: Server, healthz_url: str) -> dict:
    """Waits for every client's setup, runs them for --seconds (the kill included), and
    returns the phases' boundaries and what the kill did."""
    setup_deadline = time.monotonic() + args.setup_timeout_s
    for client in clients:
        if not client.ready.wait(max(0.0, setup_deadline - time.monotonic())):
            client.stop()  # counted as a setup failure
    start = time.time()
    until = start + args.seconds
    monitor = HealthMonitor(healthz_url, every_s=args.healthz_every_s, timeout_s=args.deadline_s)
    monitor.thread.start()
    for client in clients:
        if client.done is None and client.ready.is_set():
            client.send(f"go {until}")
    kill = None
    if args.kill_generator_after is not None:
        time.sleep(max(0.0, start + args.kill_generator_after - time.time()))
        server.note_tree()
        kill = kill_generator(healthz_url)
        limit_s = max(1.0, until - time.time())
        kill["reported_dead_after_s"] = reported_dead_after(healthz_url, kill, limit_s=limit_s)
    time.sleep(max(0.0, until - time.time()))
    # A client's last step runs to its end: each call ends by its deadline, retries included.
    drain_s = (args.retries + 1) * args.deadline_s * 4 + 30
    drain_deadline = time.monotonic() + drain_s
    for client in clients:
        try:
            client.process.wait(timeout=max(0.1, drain_deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            client.stop()
    monitor.stopped.set()
    monitor.thread.join()
    return {"start": start, "until": until, "end": time.time(), "kill": kill, "monitor": monitor}


def report(args, *, clients: list[Client], outcome: dict, config: dict, server_log: Path):
    calls = [call for c in clients for call in calls_of(c.index, c.events)]
    start, until, kill, monitor = (outcome[k] for k in ("start", "until", "kill", "monitor"))
    setup = [call for call in calls if call.start < start]
    run_calls = [call for call in calls if call.start >= start]
    # A phase holds the calls that ran in it from start to end; the kill's phases leave out
    # the calls in flight at the kill, which are reported on their own.
    if kill is None:
        bounds = {"all": (start, until, run_calls)}
    else:
        at = kill["at"]
        before = [call for call in run_calls if call.end <= at]
        after = [call for call in run_calls if call.start >= at]
        bounds = {"before_kill": (start, at, before), "after_kill": (at, until, after)}
        held = [call for call in run_calls if call.start < at < call.end]
    phases, healthz = {}, {}
    for name, (low, high, in_phase) in bounds.items():
        phases[name] = phase_figures(in_phase, seconds=high - low)
        # The last phase's probes run on while the clients finish their last calls.
        probes_end = outcome["end"] if high == until else high
        healthz[name] = healthz_figures(monitor.between(low, probes_end))
    setup_failures = sum(not call.ok for call in setup) + sum(
        (client.done is not None and not client.done["set_up"]) or not client.ready.is_set()
        for client in clients
    )
    crashed = [c.index for c in clients if c.process.returncode not in (0, None)]
    if kill is not None:
        kill = {
            "rank": kill["rank"],
            "pid": kill["pid"],
            "at_s": round(kill["at"] - start, 2),
            "reported_dead_after_s": kill["reported_dead_after_s"],
            "held_calls": held_at_kill(held),
        }
    held_calls = None if kill is None else kill["held_calls"]
    result_checks = checks(phases, healthz, held=held_calls, setup_failures=setup_failures)
    result_checks["no_client_crashed"] = not crashed
    return {
        "bench": "server_load",
        "config": config,
        "load_average": round(os.getloadavg()[0], 2),
        "errors": sum(phase["errors"] for phase in phases.values())
        + (0 if held_calls is None else held_calls["failed"])
        + setup_failures,
        "setup": {
            "calls": len(setup),
            "failures": setup_failures,
            "seconds": round(start - min((c.start for c in setup), default=start), 1),
        },
        "phases": phases,
        "healthz": healthz,
        "kill": kill,
        "server": server_statuses(server_log),
        "clients": [
            {
                "index": c.index,
                "role": c.role,
                "steps": (c.done or {}).get("steps"),
                "exit": c.process.returncode,
            }
            for c in clients
        ],
        "crashed_clients": crashed,
        "checks": result_checks,
        "met": all(result_checks.values()),
    }


# --- the command --------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="SDK client processes")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured run length")
    parser.add_argument(
        "--server-args", default="", help='added to `temper serve`, e.g. "--nproc 2"'
    )
    parser.add_argument(
        "--second-model",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve a second base model (--sample-only-model) for the base_sampler clients",
    )
    parser.add_argument(
        "--kill-generator-after",
        type=float,
        default=None,
        metavar="S",
        help="SIGKILL one generator rank S seconds into the run (needs healthz's 'ranks')",
    )
    parser.add_argument("--deadline-s", type=float, default=60.0, help="per SDK call attempt")
    parser.add_argument("--retries", type=int, default=2, help="of a retryable failure")
    parser.add_argument("--setup-timeout-s", type=float, default=300.0)
    parser.add_argument("--healthz-every-s", type=float, default=0.5)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--logprobs-every", type=int, default=4, help="base_sampler steps")
    parser.add_argument("--model-size", default="tiny", help="temper init-model --size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--server-log", default=None, help="copy the server's log here at exit (it is deleted)"
    )
    args = parser.parse_args()
    for name in ("clients", "seconds", "deadline_s", "healthz_every_s", "logprobs_every"):
        if getattr(args, name) <= 0:
            flag = "--" + name.replace("_", "-")
            raise SystemExit(f"{flag} must be > 0, got {getattr(args, name)}")
    after = args.kill_generator_after
    if after is not None and not 0 < after < args.seconds:
        raise SystemExit(f"--kill-generator-after must be in (0, --seconds), got {after}")
    return args


def make_models(root: Path, *, size: str, second_model: bool) -> tuple[Path, Path | None]:
    from temper.checkpoint.model_source import init_model_dir

    # Deep enough that the SDK's "org/model/variant" tokenizer heuristic leaves them alone.
    served = root / "models" / f"{size}-digits"
    init_model_dir(served, size=size, tokenizer="digits", seed=0)
    if not second_model:
        return served, None
    other = root / "models" / f"{size}-digits-other"
    init_model_dir(other, size=size, tokenizer="digits", seed=1)
    return served, other


def client_spec(args, *, index: int, role: str, base_url: str, api_key: str, models) -> dict:
    served, other = models
    model = other if role == "base_sampler" else served
    dims = model_dims(model)
    return {
        "role": role,
        "base_url": base_url,
        "api_key": api_key,
        "model": str(model),
        "seed": args.seed + index,
        "first_token": first_ordinary_token(model),
        "vocab_size": dims["vocab_size"],
        **{name: getattr(args, name) for name in ("rank", "group_size", "max_tokens")},
        **{name: getattr(args, name) for name in ("prompt_tokens", "learning_rate")},
        **{name: getattr(args, name) for name in ("deadline_s", "retries", "logprobs_every")},
    }


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below
    load_before = round(os.getloadavg()[0], 2)
    root = Path(tempfile.mkdtemp(prefix="temper-load-"))
    server, clients, exit_code = None, [], 0
    try:
        models = make_models(root, size=args.model_size, second_model=args.second_model)
        port, api_key = free_port(), f"tml-load-{secrets.token_hex(16)}"
        command = [sys.executable, "-m", "temper", "serve", "--model", str(models[0])]
        if models[1] is not None:
            command += ["--sample-only-model", str(models[1])]
        command += ["--host", "127.0.0.1", "--port", str(port), "--storage", str(root / "ckpt")]
        command += ["--api-key", api_key, *shlex.split(args.server_args)]
        # Held before it is ready, so that an interrupt while it starts still stops it.
        server = Server(command, log_path=root / "server.log")
        # The clients import the SDK while the server starts, and set up once it answers.
        roles = client_roles(args.clients, second_model=models[1] is not None)
        base_url = f"http://127.0.0.1:{port}"
        for index, role in enumerate(roles):
            spec = client_spec(
                args, index=index, role=role, base_url=base_url, api_key=api_key, models=models
            )
            clients.append(start_client(index, spec, root=root))
        healthz_url = f"{base_url}/api/v1/healthz"
        server.wait_ready(healthz_url)
        if args.kill_generator_after is not None:
            live_generator(get_json(healthz_url, timeout_s=10))  # fails before the run
        for client in clients:
            client.send("set-up")
        outcome = run(args, clients=clients, server=server, healthz_url=healthz_url)
        shown = ["temper", *command[3:]]
        shown[shown.index("--api-key") + 1] = "<key>"
        config = {
            **{k: v for k, v in vars(args).items() if k != "server_log"},
            "server_command": shown,
            "roles": {role: roles.count(role) for role in sorted(set(roles))},
            "model": {"size": args.model_size, **model_dims(models[0])},
            "load_average_before": load_before,
        }
        result = report(
            args, clients=clients, outcome=outcome, config=config, server_log=server.log_path
        )
        print(json.dumps(result))
    except CannotInjectFault as error:
        print(f"server_load: cannot inject the fault: {error}", file=sys.stderr)
        exit_code = CANNOT_INJECT
    finally:
        for client in clients:
            client.stop()
        if server is not None:
            server.stop()
            if args.server_log is not None and server.log_path.exists():
                shutil.copyfile(server.log_path, args.server_log)
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
