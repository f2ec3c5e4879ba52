"""bench/gpu_check.py's dry run: every check of the GPU first run runs on CPU at tiny shapes,
one JSON line each, so the command a GPU machine runs does not rot between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ["environment", "gpu_tests", "sdpa_kernels", "decode", "train_step", "moe_block"]
CHECKS += ["gated_deltanet", "rl_smoke"]
CHECKS += ["vllm", "vllm_lora", "weight_sync", "summary"]


def test_the_dry_run_runs_every_check_on_cpu():
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    lines = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert [line["check"] for line in lines] == CHECKS
    failed = [line for line in lines if not line["ok"]]
    assert not failed and result.returncode == 0, failed
    by_name = {line["check"]: line for line in lines}
    assert by_name["environment"]["cuda"] is None  # the suite hides any GPU
    assert "MATH" in by_name["sdpa_kernels"]["runs"]
    assert [row["batch"] for row in by_name["decode"]["rows"]] == [1, 4]
    assert all(row["tokens_per_s"] > 0 for row in by_name["decode"]["rows"])
    assert by_name["rl_smoke"]["last_metrics"]["step"] >= 1
    if "skipped" not in by_name["vllm"]:  # vLLM's CPU build is installed (make vllm)
        assert [row["batch"] for row in by_name["vllm"]["rows"]] == [1, 4]
        assert set(by_name["summary"]["temper_vs_vllm"]) == {"1", "4"}
        assert by_name["vllm_lora"]["mixed_tokens_per_s"] > 0
        assert by_name["vllm"]["separate_transport"] == "ipc"  # shared memory on CPU
        assert by_name["vllm"]["separate_update_weights_s"] > 0
    assert by_name["gated_deltanet"]["speedup"] > 0
    moe_cases = by_name["moe_block"]["cases"]
    assert [case["num_experts"] for case in moe_cases] == [4, 8]
    assert all(ratio > 0 for case in moe_cases for ratio in case["speedup_vs_eager"].values())
