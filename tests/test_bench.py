"""Each benchmark's flags and its one JSON line, on the smallest setting (not its numbers).

bench/ is never asserted on speed; these runs only check that a benchmark starts, finishes,
prints the fields the docs quote, and cleans up after itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from temper.sampler.cpu.decoding import CpuDecoding

ROOT = Path(__file__).parents[1]


def run_bench(script: str, *flags: str, tmp_path: Path) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path, "OMP_WAIT_POLICY": "PASSIVE"}
    environment["TMPDIR"] = str(tmp_path)  # what the benchmark leaves behind shows here
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *flags],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def left_behind(directory: Path) -> list[str]:
    """What a run left in its TMPDIR, but torch's own compile cache (kept across runs)."""
    return [p.name for p in directory.iterdir() if not p.name.startswith("torchinductor_")]


@pytest.mark.slow
def test_grpo_step_prints_both_configs_or_why_trl_is_skipped(tmp_path):
    flags = ["--steps", "1", "--warmup", "0", "--rounds", "1", "--warmup-rounds", "0"]
    report = run_bench("grpo_step.py", *flags, tmp_path=tmp_path)
    assert report["bench"] == "grpo_step" and report["temper"]["total_s"] > 0
    config = report["temper_config"]
    assert config["dtype"] == "float32" and config["gradient_checkpointing"] is False
    assert config["betas"] == [0.9, 0.95] and config["learning_rate"] == 2e-4
    (first_round,) = report["per_round"]
    assert first_round["first"] == "temper" and first_round["temper_total_s"] > 0
    try:
        import trl  # noqa: F401
    except ImportError:
        assert report["trl"] is None and "TRL not compared" in report["trl_skipped"]
    else:
        shared = ("dtype", "gradient_checkpointing", "betas", "eps", "weight_decay", "foreach")
        shared += ("learning_rate", "grad_clip_norm", "group_size", "new_tokens", "temperature")
        shared += ("prompts", "prompt_tokens_per_step")  # the same problems on both sides
        assert {k: report["trl_config"][k] for k in shared} == {k: config[k] for k in shared}
        assert len(report["speedup_per_round"]) == 1 and first_round["trl_total_s"] > 0
    assert left_behind(tmp_path) == []


@pytest.mark.slow
def test_server_overhead_reports_the_server_process_cpu_and_cleans_up(tmp_path):
    flags = ["--steps", "2", "--prompts", "2", "--group-size", "2", "--max-tokens", "2"]
    report = run_bench("server_overhead.py", *flags, tmp_path=tmp_path)
    assert report["bench"] == "server_overhead" and report["server_s"] > 0
    assert report["like_for_like"] and report["in_process_threads"] == report["server_threads"]
    for name in ("in_process", "server", "sdk", "server_idle"):
        assert report[f"cpu_{name}_s"] >= 0
    assert report["cpu_server_over_in_process"] > 0
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= 2:  # pinned by default: the server's threads on cores of their own
        pinned = report["pinned"]
        assert pinned["bench_cores"] == cores[: len(cores) // 2]
        assert pinned["server_cores"] == cores[len(cores) // 2 :]  # read back, every thread
    else:
        assert report["pinned"] is None
    assert left_behind(tmp_path) == []


@pytest.mark.slow
def test_server_overhead_without_pinning_shares_the_cores(tmp_path):
    flags = ["--steps", "1", "--prompts", "1", "--group-size", "1", "--max-tokens", "1"]
    report = run_bench("server_overhead.py", *flags, "--no-pin", tmp_path=tmp_path)
    assert report["pinned"] is None and report["server_s"] > 0


@pytest.mark.slow
def test_server_load_runs_every_role_without_errors_and_cleans_up(tmp_path):
    report = run_bench("server_load.py", "--clients", "3", "--seconds", "2", tmp_path=tmp_path)
    config = report["config"]
    assert config["server_command"][:2] == ["temper", "serve"]
    assert "--sample-only-model" in config["server_command"]
    assert config["roles"] == {"rl": 1, "lora_sampler": 1, "base_sampler": 1}
    assert report["errors"] == 0 and report["kill"] is None and report["met"]
    verbs = report["phases"]["all"]["verbs"]
    rl_verbs = ("save_weights_and_get_sampling_client", "forward_backward", "optim_step")
    for verb in ("sample", "compute_logprobs", *rl_verbs):
        assert verbs[verb]["calls"] > 0 and verbs[verb]["p99_ms"] >= verbs[verb]["p50_ms"] > 0
    assert verbs["sample"]["tokens_per_s"] > 0
    assert report["healthz"]["all"]["answered"] == report["healthz"]["all"]["polls"] > 0
    assert left_behind(tmp_path) == []


@pytest.mark.slow
def test_sampler_reports_engine_and_rl_job_defaults(tmp_path):
    flags = ["--quick", "--repeats", "1", "--batches", "1"]
    report = run_bench("sampler.py", *flags, tmp_path=tmp_path)
    (case,) = report["cases"]
    assert case["batch"] == 1 and case["hf_tokens_per_s"] > 0
    # The engine's default: a process per core (batch 1 never splits, so none starts).
    assert case["temper_cpu_processes"] == CpuDecoding.Config().num_processes()
    assert case["rl_job_threads"] == 1  # RLJob.Config().sampler.cpu
    assert case["speedup_vs_hf"] == case["temper_speedup_vs_hf"] > 0
    assert case["rl_job_speedup_vs_hf"] > 0
    assert "processes='auto'" in report["rl_job_cpu_config"]
    assert left_behind(tmp_path) == []


@pytest.mark.slow
def test_multiturn_reports_concurrency_and_the_prefix_cache(tmp_path):
    flags = ["--episodes", "4", "--repeats", "1", "--warmup-steps", "20"]  # several turns
    report = run_bench("multiturn.py", *flags, tmp_path=tmp_path)
    cases = ("concurrent", "concurrent_no_prefix_cache", "naive")
    assert all(report[case]["episodes_per_s"] > 0 for case in cases)
    # The same episodes: without the cache every turn prefills the conversation again.
    with_cache = report["concurrent"]["prefilled_tokens_per_episode"]
    assert report["concurrent_no_prefix_cache"]["prefilled_tokens_per_episode"] > with_cache
    assert report["speedup"] > 0 and report["prefix_cache_speedup"] > 0
    assert left_behind(tmp_path) == []


def test_prefix_cache_prefills_a_shared_system_prompt_once(tmp_path):
    flags = ["--calls", "3", "--requests", "2", "--system-tokens", "40", "--repeats", "1"]
    report = run_bench("prefix_cache.py", *flags, tmp_path=tmp_path)
    # Calls 2 and 3 copy the system prompt's two whole blocks (32 of 40 tokens) per request.
    prefilled = report["prefilled_tokens_per_call"]
    assert prefilled["uncached"] == 2 * 48
    assert prefilled["cached"] == pytest.approx((3 * 96 - 4 * 32) / 3, abs=0.05)
    assert report["cached_s"] > 0 and report["uncached_s"] > 0
    assert "prefix_cache_mib=0.0" in report["configs"]["uncached"]
    assert left_behind(tmp_path) == []


@pytest.mark.slow
def test_multi_lora_reports_memory_and_mixed_speed_per_client_count(tmp_path):
    flags = ["--clients", "1", "2", "--models", "tiny", "--rounds", "1", "--rank", "2"]
    flags += ["--total-batch", "4", "--max-tokens", "4", "--seq-len", "32"]
    report = run_bench("multi_lora.py", *flags, tmp_path=tmp_path)
    tiny = report["models"]["tiny"]
    for path in ("shared", "merged"):
        one, two = tiny[path]
        assert one["clients"] == 1 and two["clients"] == 2
        assert one["tokens_per_s"] > 0 and two["marginal_mib_per_client"] is not None
        assert two["marginal_target_mib"] == round(9 * two["adapter_mib"], 2)
    assert left_behind(tmp_path) == []


@pytest.mark.slow
def test_weight_sync_reports_each_case_side_by_side_and_exact_weights(tmp_path):
    flags = ["--shapes", "tiny", "--bucket-mb", "16", "--warmup", "0", "--repeats", "1"]
    report = run_bench("weight_sync.py", *flags, tmp_path=tmp_path)
    assert report["bench"] == "weight_sync" and report["config"]["world_size"] == 3
    tiny = report["shapes"]["tiny"]
    assert tiny["weights_exact"] is True
    for case in (*tiny["colocated"].values(), tiny["gather_only"]):
        assert case["time_s"] > 0 and set(case["peak_extra_mib"]) == {"trainer_0", "trainer_1"}
    disaggregated = tiny["disaggregated"]
    assert set(disaggregated["peak_extra_mib"]) == {"trainer_0", "trainer_1", "generator"}
    # Each trainer rank sends its own rows (38.6 MiB): its half of the embedding (37 MiB)
    # split by rows over 16 MiB buckets, the rest after it.
    assert disaggregated["buckets"] == [4, 4] and disaggregated["mib"] == [38.6, 38.6]
    assert sum(disaggregated["mib"]) >= tiny["plain_broadcast"]["mib"] > 0
    assert disaggregated["largest_bucket_mib"] <= 16
    assert tiny["disaggregated_over_plain_broadcast"] > 0
    overlap = tiny["overlap"]
    assert overlap["time_s"] > 0 and 0 < overlap["generator_blocked_s"] < overlap["time_s"]
    assert set(tiny["targets"]) == {
        "disaggregated_peak_extra_le_2_buckets",
        "colocated_streamed_peak_extra_le_2_buckets",
        "disaggregated_le_2x_plain_broadcast",
    }
    assert left_behind(tmp_path) == []


@pytest.mark.slow
def test_routing_replay_reports_both_runs_and_no_disagreement_with_replay(tmp_path):
    flags = ["--warmup-steps", "4", "--rl-steps", "2"]
    report = run_bench("routing_replay.py", *flags, tmp_path=tmp_path)
    assert report["bench"] == "routing_replay" and report["dtype"] == "bf16-mixed"
    off, replayed = report["results"]["off"], report["results"]["sampler"]
    for run in (off, replayed):
        assert run["rl_seconds_per_step"] > 0 and 0 <= run["eval_final"] <= 1
        assert "mismatch/kl:mean" in run and "mismatch/router_topk_diff:mean" in run
    assert replayed["mismatch/topk_diff:max"] == 0
    assert off["mismatch/topk_diff:mean"] == off["mismatch/router_topk_diff:mean"]


def test_moe_ep_reports_both_modes_and_the_plan(tmp_path):
    flags = ["--layers", "1", "--dim", "64", "--experts", "4", "--expert-width", "64"]
    flags += ["--vocab", "64", "--sequences", "2", "--seq-len", "16", "--warmup", "1"]
    report = run_bench("moe_ep.py", *flags, "--steps", "1", tmp_path=tmp_path)
    assert report["bench"] == "moe_ep"
    for mode in ("ep2", "fsdp"):
        for key in ("experts_held_mib", "experts_gathered_mib", "step_s", "peak_extra_mib"):
            assert len(report[mode][key]) == 2
    # ep 2 gathers half of what FSDP gathers (0.1875 and 0.375 MiB).
    ep2_mib, fsdp_mib = (
        report["ep2"]["experts_gathered_mib"],
        report["fsdp"]["experts_gathered_mib"],
    )
    for ep2, fsdp in zip(ep2_mib, fsdp_mib, strict=True):
        assert ep2 == pytest.approx(fsdp / 2, abs=1e-3)
    assert report["targets"] == {
        "ep2_holds_half_the_expert_bytes": True,
        "plan_within_5_percent": True,
    }
    assert left_behind(tmp_path) == []


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_multi_lora_reports_each_path_and_sync_bytes(tmp_path):
    pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
    flags = ["--users", "2", "--total-batch", "4", "--max-tokens", "4", "--rounds", "1"]
    flags += ["--rank", "8", "--sync-size", "tiny"]
    report = run_bench("vllm_multi_lora.py", *flags, tmp_path=tmp_path)
    assert set(report["tokens_per_s"]) == {"merged", "one_user", "users"}
    assert all(speed > 0 for speed in report["tokens_per_s"].values())
    assert 0 < report["sync"]["attn"]["ratio"] < report["sync"]["all"]["ratio"] < 1
    assert left_behind(tmp_path) == []
