"""The RL job on the vLLM generator learns like it does on Temper's engine: the same recipe,
seed and (shortened) schedule, held-out accuracy compared with Temper's on that command. The
full 1500-step recipe on vLLM is in docs/sampler.md; `make test-vllm` runs this."""

from __future__ import annotations

import pytest

from temper.cli import main
from temper.observability import read_metrics

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = ["--rl.steps", "200", "--rl.eval_every", "100", "--eval_problems", "256"]


def _run(tmp_path, backend: str) -> tuple[float, float, dict]:
    run_dir = tmp_path / backend
    argv = ["train", "sum_digits_short_warmup", "--run-dir", str(run_dir), *STEPS]
    argv += ["--generator.backend", backend, "--metrics.display", "none"]
    assert main(argv) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    after_warmup = next(acc for step, acc in evals if step == 149)
    rl_record = next(r for r in records if "reward/mean" in r)
    return after_warmup, evals[-1][1], rl_record


# Temper's engine on this exact command (seed 0, reproducible on one CPU type; measured on the
# 2-core AVX2 VM CI uses): held-out 0.312 after the warm-up, 0.523 after 200 RL steps
# (tests/rl/test_job.py runs it and checks the lift).
TEMPER_AFTER_WARMUP, TEMPER_FINAL = 0.312, 0.523


def test_rl_on_vllm_learns_like_rl_on_temper(tmp_path):
    warmup, final, rl_record = _run(tmp_path, "vllm")
    # The warm-up trains and evaluates greedily, the same on both backends.
    assert abs(warmup - TEMPER_AFTER_WARMUP) < 0.03, warmup
    # RL samples differ (vLLM draws with its own random streams), so the runs differ as two
    # seeds do. Measured: vLLM 0.31 -> 0.57 (Temper 0.31 -> 0.52).
    assert final >= warmup + 0.12, (warmup, final)
    assert abs(final - TEMPER_FINAL) < 0.15, final
    # The mismatch metrics work on either backend: vLLM's logprobs against the trainer's.
    assert rl_record["mismatch/logprob_diff_max"] < 1e-4
