"""A tiny RL job that trains in seconds and has reward signal from its first RL step."""

from __future__ import annotations

import dataclasses

import pytest
from safetensors.torch import load_file

from temper.observability import MetricsLogger, read_metrics
from temper.rl.job import RLJob
from temper.rl.steps import RLSteps
from temper.rl.warmup import SFTWarmup
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine
from temper.tasks import SumDigits

# Keys that measure wall-clock time and so differ between otherwise identical runs.
TIMING_PREFIXES = ("time/", "throughput/", "episode/env_seconds")


STEPS_FIELDS = {field.name for field in dataclasses.fields(RLSteps.Config)}
"""Overrides by these names set the steps' own config (`config.rl`)."""


def tiny_rl_config(**overrides) -> RLJob.Config:
    config = RLJob.Config(
        task=SumDigits.Config(min_digits=1, max_digits=2, heldout_percent=20),
        warmup=SFTWarmup.Config(steps=8, batch_size=16, warmup_steps=2),
        rl=RLSteps.Config(
            steps=6, prompts_per_step=6, group_size=4, learning_rate=1e-3, eval_every=3
        ),
        eval_problems=16,
        sampler=SamplerEngine.Config(
            max_batch=64, max_seq_len=32, cpu=CpuDecoding.Config(num_threads=1)
        ),
        metrics=MetricsLogger.Config(display="none"),
    )
    for name, value in overrides.items():
        setattr(config.rl if name in STEPS_FIELDS else config, name, value)
    config.rl.__post_init__()
    config.__post_init__()
    return config


def comparable_metrics(run_dir) -> list[dict]:
    """metrics.jsonl without wall-clock fields."""
    return [
        {k: v for k, v in record.items() if k != "time" and not k.startswith(TIMING_PREFIXES)}
        for record in read_metrics(run_dir / "metrics.jsonl")
    ]


def final_weights(run_dir, result) -> dict:
    run_id, _, name = result.sampler_path.removeprefix("tinker://").split("/")
    return load_file(
        str(run_dir / "checkpoints" / run_id / "sampler_weights" / name / "model.safetensors")
    )


@pytest.fixture
def tiny_config():
    return tiny_rl_config


@pytest.fixture
def no_plots(monkeypatch):
    """Skip drawing PNGs (seconds of matplotlib per run, irrelevant to these tests)."""
    monkeypatch.setattr(
        "temper.job.run_checkpoints.plot_metrics", lambda run_dir: [run_dir / "plots" / "none.png"]
    )
