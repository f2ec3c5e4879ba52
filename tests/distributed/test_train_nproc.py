"""`temper train RECIPE --nproc 2` starts torchrun, runs the RL recipe on two ranks, and only
rank 0 writes and prints; bad --nproc values are usage errors."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from temper.cli import main
from temper.config.cli import without_option
from temper.distributed.launch import torchrun_command, torchrun_environment
from temper.observability import read_metrics
from tests.distributed.spawn import free_port


def test_train_nproc_2_runs_the_recipe_on_two_ranks(tmp_path, capfd):
    run_dir = tmp_path / "run"
    argv = ["train", "arithmetic_smoke", "--nproc", "2", "--run-dir", str(run_dir)]
    argv += ["--metrics.display", "none", "--warmup.steps", "4", "--rl.steps", "2"]
    argv += ["--eval_problems", "8"]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert out.count("SFT warm-up: 4 steps") == 1  # rank 1 prints nothing
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(6))
    assert json.loads((run_dir / "config.json").read_text())["recipe"] == "arithmetic_smoke"
    (run_id,) = [path.name for path in (run_dir / "checkpoints").iterdir()]
    assert (run_dir / "checkpoints" / run_id / "sampler_weights" / "final").is_dir()
    assert (run_dir / "plots" / "learning.png").is_file()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--sharding.dims.dp_shard", "3"], "ParallelDims: dp_replicate (1) x dp_shard (3)"),
        (["--rl.prompts_per_step", "7"], "RLJob.Config.rl.prompts_per_step=7 must be divisible"),
        (
            ["--placement.mode", "disaggregated", "--placement.generator_ranks", "2"],
            "Placement.Config.generator_ranks=2 leaves no trainer rank",
        ),
    ],
)
def test_settings_that_do_not_fit_nproc_fail_before_torchrun_starts(
    override, message, tmp_path, capfd
):
    # (Every rank checks them too, before any collective: test_rl_spmd.py, test_disaggregated.py.)
    run_dir = tmp_path / "run"
    argv = ["train", "arithmetic_smoke", "--nproc", "2", "--run-dir", str(run_dir)]
    assert main([*argv, *override]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"temper train: error: {message}")
    assert "torch.distributed" not in err  # no rank was started
    assert not run_dir.exists()


def test_a_one_process_job_is_refused_with_nproc(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "sum_digits_smoke", "--nproc", "2", "--run-dir", str(run_dir)]) == 2
    assert "runs in one process only" in capsys.readouterr().err
    assert not run_dir.exists()


def test_train_nproc_rejects_bad_values(tmp_path, capsys):
    for value in ("0", "two"):
        assert main(["train", "arithmetic_smoke", "--nproc", value]) == 2
        assert "--nproc" in capsys.readouterr().err


def test_a_one_process_job_is_refused_under_torchrun(monkeypatch, capsys):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert main(["train", "sum_digits_smoke"]) == 2  # an SFT job: no process group is joined
    assert "runs in one process only" in capsys.readouterr().err


def test_torchrun_command_and_environment():
    assert without_option(["r", "--nproc", "2", "--x", "1", "--nproc=3"], "--nproc") == [
        "r",
        "--x",
        "1",
    ]
    command = torchrun_command(nproc=4, args=["train", "r"])
    assert command[1:] == [
        "-m",
        "temper.distributed.torchrun_main",  # torchrun, quiet when stopped by a signal
        "--standalone",
        "--nproc-per-node=4",
        "-m",
        "temper",
        "train",
        "r",
    ]
    env = torchrun_environment(nproc=64, environ={})
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    assert torchrun_environment(nproc=2, environ={"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize("argv", [["--resume", "x", "--nproc", "2", "--run-dir", "y"]])
def test_resume_takes_nproc_but_no_other_option(argv, capsys):
    assert main(["train", *argv]) == 2
    assert "takes no other options" in capsys.readouterr().err


def test_two_nodes_meet_at_the_rendezvous_and_run_disaggregated(tmp_path):
    """Two `temper train --nnodes 2` commands on this machine stand for two nodes of one
    rank each: they meet at the rendezvous endpoint, rank 0 prepares the shared run dir, and
    the job runs with the last rank generating for the first."""
    run_dir = tmp_path / "shared-run"
    argv = ["train", "arithmetic_smoke", "--nnodes", "2", "--nproc-per-node", "1"]
    argv += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--run-dir", str(run_dir)]
    argv += ["--metrics.display", "none", "--warmup.steps", "2", "--rl.steps", "2"]
    argv += ["--eval_problems", "8", "--placement.mode", "disaggregated"]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "temper", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert sum(output.count("SFT warm-up: 2 steps") for output in outputs) == 1
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(4))


def test_several_nodes_need_their_settings(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    cases = {
        ("--nnodes", "2", "--nproc-per-node", "2", "--run-dir", run_dir): "--rdzv-endpoint",
        ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "h:1"): "--run-dir",
        ("--nnodes", "2", "--rdzv-endpoint", "h:1", "--run-dir", run_dir): "--nproc-per-node",
        ("--nproc", "2", "--rdzv-endpoint", "h", "--run-dir", run_dir): "HOST:PORT",
        ("--nproc", "2", "--nproc-per-node", "3"): "give one of them",
    }
    for options, expected in cases.items():
        assert main(["train", "arithmetic_smoke", *options]) == 2
        assert expected in capsys.readouterr().err, options
    assert not (tmp_path / "run").exists()


def test_the_torchrun_command_for_several_nodes_uses_the_rendezvous():
    command = torchrun_command(
        nproc=8, args=["train"], nnodes=2, rdzv_endpoint="node0:29500", run_id="run-x"
    )
    assert "--standalone" not in command
    for part in ("--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500"):
        assert part in command
    assert "--rdzv-id=run-x" in command and "--nproc-per-node=8" in command
    assert "--standalone" in torchrun_command(nproc=2, args=["train"])


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds `text` (from /proc)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if proc.name.isdigit() and text in cmdline:
            pids.append(int(proc.name))
    return pids


@contextlib.contextmanager
def _run_past_first_checkpoint(run_dir: Path) -> Iterator[subprocess.Popen]:
    """`temper train --nproc 2` of a long run, once it has saved its first full-state
    checkpoint; whatever of it is left afterwards is killed."""
    argv = ["train", "arithmetic_smoke", "--nproc", "2", "--run-dir", str(run_dir)]
    argv += ["--metrics.display", "none", "--rl.steps", "1000", "--checkpoint_every", "5"]
    command = subprocess.Popen(
        [sys.executable, "-m", "temper", *argv],
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "run_state" / "state.json").exists():
            assert command.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        yield command
    finally:
        for pid in _processes_naming(str(run_dir)):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="lists processes through /proc")
def test_ctrl_c_stops_every_rank_and_says_how_to_resume(tmp_path):
    """SIGINT to `temper train --nproc 2` ends torchrun and both ranks (none trains on,
    orphaned, after torchrun is gone) and prints the resume command."""
    run_dir = tmp_path / "run"
    with _run_past_first_checkpoint(run_dir) as command:
        command.send_signal(signal.SIGINT)
        # A rank left running would hold stderr open: communicate would time out.
        err = command.communicate(timeout=60)[1]
        assert command.returncode == 130, err
        assert f"temper train --resume {run_dir} --nproc 2" in err
        assert "SignalException" not in err and "Traceback" not in err, err  # torchrun's own
        assert _processes_naming(str(run_dir)) == []


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="lists processes through /proc")
def test_a_rank_that_dies_ends_the_run_with_the_resume_command(tmp_path):
    """torchrun stops the other ranks at once, before they can say anything: the command says
    how to go on."""
    run_dir = tmp_path / "run"
    with _run_past_first_checkpoint(run_dir) as command:
        (rank_1,) = [
            pid
            for pid in _processes_naming(str(run_dir))
            if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
        ]
        os.kill(rank_1, signal.SIGKILL)
        err = command.communicate(timeout=60)[1]
        assert command.returncode != 0
        assert f"`temper train --resume {run_dir} --nproc 2` continues" in err
