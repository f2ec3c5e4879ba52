"""Bad RL settings fail when the config is made, before any model is built or step trained."""

from __future__ import annotations

import json

import pytest

from temper.distributed.placement import Placement
from temper.generator.choice import GeneratorChoice
from temper.generator.vllm import VllmGenerator
from temper.rl.job import RLJob
from temper.rl.steps import RLSteps
from temper.trainer.engine import TrainerEngine
from temper.trainer.sharding import Sharding


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": "async", "max_staleness": -1}, "max_staleness must be >= 0, got -1"),
        ({"mode": "eager"}, "mode must be 'sync', 'async' or 'inflight'"),
        ({"checkpoint_every": -1}, "checkpoint_every must be >= 0"),
        ({"sleep_generator": True, "mode": "async"}, "sleep_generator needs mode='sync'"),
        (
            {
                "placement": Placement.Config(
                    mode="disaggregated", generator_ranks=2, generator_tp=2
                )
            },
            r"placement.generator_tp=2 needs RLJob.Config.generator.backend='vllm'",
        ),
        (
            {
                "placement": Placement.Config(mode="disaggregated"),
                "generator": GeneratorChoice.Config(
                    backend="vllm", vllm=VllmGenerator.Config(tensor_parallel_size=2)
                ),
            },
            "tensor_parallel_size is set by the placement on generator ranks",
        ),
        (
            {
                "rl": RLSteps.Config(sampling_support="sampler"),
                "generator": GeneratorChoice.Config(backend="vllm"),
            },
            r"rl.sampling_support='sampler' with the vllm backend needs RLJob.Config.rl.top_k",
        ),
        (
            {"trainer": TrainerEngine.Config(sharding=Sharding.Config())},
            r"trainer.sharding is set by the loop on several ranks; configure it through "
            r"RLJob.Config.sharding",
        ),
    ],
)
def test_bad_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        RLJob.Config(**fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"group_size": 1}, "group_size must be >= 2"),
        ({"prompts_per_step": 6, "num_substeps": 4}, r"prompts_per_step \(6\) must be divisible"),
        ({"num_substeps": 0}, "num_substeps must be >= 1"),
        ({"steps": -5}, "steps must be >= 0, got -5"),
        ({"learning_rate": -1.0}, "learning_rate must be >= 0, got -1.0"),
        ({"kl_coef": -0.1}, "kl_coef must be >= 0"),
        ({"kl_estimator": "k2"}, "kl_estimator must be 'k1' or 'k3'"),
        ({"lr_schedule": "linear"}, "lr_schedule must be 'constant' or 'cosine'"),
        ({"top_p": 0.0}, r"RLSteps\.Config\.top_p must be in \(0, 1\]"),
        ({"top_k": 0}, r"RLSteps\.Config\.top_k must be >= 1, or -1"),
        ({"sampling_support": "kept"}, "sampling_support must be 'full' or 'sampler'"),
        (
            {"sampling_support": "sampler", "temperature": 0.0},
            "sampling_support='sampler' needs temperature > 0",
        ),
    ],
)
def test_bad_step_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        RLSteps.Config(**fields)


def test_staleness_without_async_mode_warns():
    with pytest.warns(UserWarning, match="max_staleness=3 is ignored in mode='sync'"):
        RLJob.Config(max_staleness=3)


def test_config_json_names_the_job_config():
    # config.json names this class; loading it imports temper.rl.job, so it builds an RLJob.
    assert (
        RLJob.Config.__module__ == "temper.rl.job" and RLJob.Config.__qualname__ == "RLJob.Config"
    )
    assert isinstance(RLJob.Config().build(), RLJob)


def test_a_flag_of_a_setting_that_moved_names_its_new_flag(tmp_path, capsys):
    from temper.cli import main

    run_dir = tmp_path / "run"
    for flag in ("--group_size", "--group-size", "--kl_coef=0.1"):
        assert main(["train", "sum_digits", "--run-dir", str(run_dir), flag, "8"]) == 2
        err = capsys.readouterr().err
        assert (
            f"--{flag.removeprefix('--').partition('=')[0].replace('-', '_')} is now --rl." in err
        )
        assert not run_dir.exists()


def test_a_config_saved_with_a_moved_field_names_its_new_place(tmp_path):
    from temper.config import serialize

    path = tmp_path / "config.json"
    serialize.save_config(path, RLJob.Config(), recipe=None)
    saved = json.loads(path.read_text())
    saved["config"]["group_size"] = saved["config"]["rl"].pop("group_size")
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"unknown field 'group_size' .*now 'rl\.group_size'"):
        serialize.load_config(path)
