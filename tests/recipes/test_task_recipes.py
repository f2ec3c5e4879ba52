"""The task recipes (arithmetic, reverse_text, gsm8k) and choosing a task in a job's config:
recipes build, configs round-trip through config.json, the CLI picks and overrides tasks, bad
task input fails before training, and a short arithmetic run goes end to end."""

from __future__ import annotations

import dataclasses
import json
import random
import typing

import pytest
import torch

from temper.cli import main
from temper.config import get_recipe, list_recipes
from temper.config.cli import parse_train_argv
from temper.config.serialize import config_from_dict, config_to_dict, load_config, save_config
from temper.observability import read_metrics
from temper.rl.job import RLJob
from temper.sft import SFTJob
from temper.tasks import Arithmetic, Math, ReverseText, SumDigits, TaskConfig
from tests.tasks.test_math_task import SAMPLE

TASK_RECIPES = ("arithmetic", "arithmetic_smoke", "reverse_text", "gsm8k_qwen3_0_6b")
TASK_CONFIGS = (
    SumDigits.Config(min_digits=3),
    Arithmetic.Config(ops=("mul",), max_digits=2),
    ReverseText.Config(alphabet="xyz"),
    Math.Config(path=str(SAMPLE), heldout_percent=20),
)


def test_task_recipes_are_listed():
    assert set(TASK_RECIPES) <= {info.name for info in list_recipes()}


@pytest.mark.parametrize("name", TASK_RECIPES)
def test_recipe_builds_its_task_and_round_trips(name, tmp_path):
    config = get_recipe(name).fn()
    assert isinstance(config.build(), RLJob)
    task = config.task.build()  # reads and checks the data file for the math task
    problem = task.sample(random.Random(0), split="heldout")
    assert task.reward(problem, problem.answer) == 1.0
    save_config(tmp_path / "config.json", config, recipe=name)
    assert load_config(tmp_path / "config.json").config == config


def test_task_configs_have_distinct_field_sets():
    """config.json has no type tag: a task config is recognized by its field names."""
    members = typing.get_args(TaskConfig)
    assert {type(config) for config in TASK_CONFIGS} == set(members)
    field_sets = {frozenset(f.name for f in dataclasses.fields(member)) for member in members}
    assert len(field_sets) == len(members)


@pytest.mark.parametrize("task", TASK_CONFIGS, ids=lambda task: type(task).__qualname__)
@pytest.mark.parametrize("job", [RLJob.Config, SFTJob.Config], ids=["rl", "sft"])
def test_every_task_round_trips_in_every_job(job, task):
    config = job(task=task)
    data = json.loads(json.dumps(config_to_dict(config)))
    assert config_from_dict(job, data) == config


def test_a_saved_task_with_unknown_fields_is_rejected(tmp_path):
    data = config_to_dict(RLJob.Config())
    data["task"] = {"numbers": 3}
    with pytest.raises(ValueError, match="field 'task'"):
        config_from_dict(RLJob.Config, data)


def test_cli_picks_a_task_and_overrides_its_fields():
    # Another task starts from its defaults; the recipe's own task keeps the recipe's values.
    argv = ["arithmetic", "task:reverse-text", "--task.max_length", "9"]
    assert parse_train_argv(argv).config.task == ReverseText.Config(max_length=9)
    argv = ["arithmetic", "task:arithmetic", "--task.ops", "add", "mul"]
    task = parse_train_argv(argv).config.task
    assert task == Arithmetic.Config(ops=("add", "mul"), min_digits=1, max_digits=2)
    argv = [
        "gsm8k_qwen3_0_6b",
        "--model.base_model",
        "/m/Qwen3-0.6B",
        "task:math",
        "--task.path",
        "t",
    ]
    config = parse_train_argv(argv).config
    assert config.model.base_model == "/m/Qwen3-0.6B" and config.task == Math.Config(path="t")


def test_unknown_task_name_is_a_clear_error(tmp_path, capsys):
    argv = ["train", "arithmetic", "--run-dir", str(tmp_path / "run"), "task:division"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "task:division" in err and "task:arithmetic" in err and "task:math" in err
    assert not (tmp_path / "run").exists()


def test_malformed_dataset_stops_the_run_before_training(tmp_path, capsys):
    data = tmp_path / "problems.jsonl"
    data.write_text(SAMPLE.read_text().splitlines()[0] + '\n{"question": "Q?", "answer": "7"}\n')
    run_dir = tmp_path / "run"
    argv = ["train", "arithmetic_smoke", "--run-dir", str(run_dir), "--metrics.display", "none"]
    assert main([*argv, "task:math", "--task.path", str(data)]) == 1
    assert f"{data}:2: the answer must end with '#### <number>'" in capsys.readouterr().err
    assert not (run_dir / "metrics.jsonl").exists()


def test_missing_model_directory_fails_clearly(tmp_path, capsys):
    model_dir = tmp_path / "models" / "Qwen3-0.6B"
    argv = [
        "train",
        "gsm8k_qwen3_0_6b",
        "--run-dir",
        str(tmp_path / "run"),
        "--model.device",
        "cpu",
    ]
    assert main([*argv, "--model.base_model", str(model_dir)]) == 1
    err = capsys.readouterr().err
    assert str(model_dir) in err and "neither a model directory" in err
    assert "--model.base_model" in err  # the flag to fix


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's error")
def test_a_cuda_recipe_on_a_cpu_machine_names_the_device_flag(tmp_path, capsys):
    argv = ["train", "gsm8k_qwen3_0_6b", "--run-dir", str(tmp_path / "run")]
    assert main([*argv, "--model.base_model", "tiny"]) == 1
    err = capsys.readouterr().err
    assert "--model.device is 'cuda'" in err and "pass --model.device cpu" in err


def test_arithmetic_smoke_run_trains_and_evaluates(tmp_path):
    run_dir = tmp_path / "run"
    argv = ["train", "arithmetic_smoke", "--run-dir", str(run_dir), "--metrics.display", "none"]
    assert main(argv) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert len([r for r in records if "reward/mean" in r]) == 4
    assert len([r for r in records if "warmup/loss" in r]) == 20
    accuracies = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert accuracies and all(0.0 <= a <= 1.0 for a in accuracies)
    assert load_config(run_dir / "config.json").config.task == Arithmetic.Config(
        ops=("add", "sub"), min_digits=1, max_digits=2
    )


def test_math_task_runs_through_the_rl_loop(tmp_path):
    """The shipped sample file on a tiny letters model: the plumbing, not learning."""
    run_dir = tmp_path / "run"
    argv = ["train", "arithmetic_smoke", "--run-dir", str(run_dir), "--metrics.display", "none"]
    argv += [
        "--model.base_model",
        "tiny:letters",
        "--rl.max_tokens",
        "8",
        "--sampler.max_seq_len",
        "256",
    ]
    argv += ["--warmup.steps", "2", "--warmup.batch_size", "4", "--eval_problems", "4"]
    assert main([*argv, "task:math", "--task.path", str(SAMPLE)]) == 0
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts[0]["prompt"].startswith("Question: ")
