"""`temper plan RECIPE` through the real entry point, and the plans printed in
docs/distributed.md."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from temper.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
_PLAN_AND_OUTPUT = re.compile(r"```bash\n(temper plan [^`]*?)\n```\n\n```text\n(.*?)\n```", re.S)

# The GSM8K recipe: LoRA rank 32, bf16, 32 prompts x 8 samples of up to 1024 tokens.
RECIPE = ["gsm8k_qwen3_0_6b", "--model.base_model", "8B"]
SPLIT = [*RECIPE, "--nnodes", "2", "--nproc-per-node", "8", "--rl.prompts_per_step", "24"]
SPLIT += ["--placement.mode", "disaggregated", "--placement.generator_ranks", "4"]
SPLIT += ["--sampler.max_batch", "64"]


def test_plan_prints_a_table_per_role_and_whether_it_fits(capsys):
    assert main(["plan", *SPLIT]) == 0
    out = capsys.readouterr().out
    assert "trainer: 12 trainer ranks (FSDP over 12)" in out
    assert "generator: 4 generator ranks (4 engines)" in out
    assert "| KV cache: 64 slots x 1024 tokens" in out
    assert "| peak while training " in out and "| peak at weight sync " in out
    assert out.rstrip().splitlines()[-1].startswith("fits: trainer peaks at")


def test_the_plan_takes_its_settings_from_the_recipe_and_its_overrides(capsys):
    assert main(["plan", *RECIPE, "--nproc", "8"]) == 0
    recipe = capsys.readouterr().out
    assert recipe.startswith("8B (8.19B parameters), LoRA rank 32, bf16-mixed; 1 x 8 ranks")
    assert "batch 256 x 1024 tokens" in recipe  # 32 prompts x 8, the sampler's max_seq_len
    assert "| KV cache: 256 slots x 1024 tokens" in recipe  # the recipe's sampler.max_batch
    overrides = ["--model.lora_rank", "8", "--rl.group_size", "4", "--sampler.max_seq_len", "512"]
    assert main(["plan", *RECIPE, "--nproc", "8", *overrides]) == 0
    changed = capsys.readouterr().out
    assert "LoRA rank 8" in changed and "batch 128 x 512 tokens" in changed


def test_plan_says_when_it_does_not_fit(capsys):
    assert main(["plan", "gsm8k_qwen3_0_6b", "--model.base_model", "32B", "--nproc", "16"]) == 0
    assert "DOES NOT FIT: colocated peaks at" in capsys.readouterr().out


def test_bad_settings_are_a_clean_error_naming_the_field(capsys):
    split = ["plan", *RECIPE, "--nproc", "8", "--placement.mode", "disaggregated"]
    assert main([*split, "--placement.generator_ranks", "8"]) == 2
    err = capsys.readouterr().err
    assert "temper plan: error: Placement.Config.generator_ranks=8 leaves no trainer rank" in err
    assert "Traceback" not in err


def test_a_model_that_is_neither_a_size_nor_a_directory_names_its_flag(capsys):
    assert main(["plan", "gsm8k_qwen3_0_6b", "--model.base_model", "3B"]) == 2
    assert "temper plan: error: --model.base_model: model '3B'" in capsys.readouterr().err


def test_a_recipe_without_a_memory_plan_is_a_clean_error(capsys):
    assert main(["plan", "sum_digits_sft"]) == 2
    assert "SFTJob, which has no memory plan" in capsys.readouterr().err


def test_disaggregated_has_one_generator_rank_unless_told(capsys):
    # As in `temper train`, whose --placement.generator_ranks defaults to 1.
    assert main(["plan", *RECIPE, "--nproc", "5", "--placement.mode", "disaggregated"]) == 0
    assert "generator: 1 generator rank" in capsys.readouterr().out


def _documented_plans() -> list[tuple[str, str]]:
    return _PLAN_AND_OUTPUT.findall(DOC.read_text())


def test_the_docs_show_plans():
    assert len(_documented_plans()) == 4


@pytest.mark.parametrize(("command", "output"), _documented_plans())
def test_documented_plans_are_the_commands_output(command, output, capsys):
    argv = shlex.split(command.replace("\\\n", " "))
    assert main(argv[1:]) == 0
    assert capsys.readouterr().out.rstrip("\n") == output, (
        f"docs/distributed.md shows an outdated plan for `{command}`; paste its output again"
    )


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_plan_of_a_model_directory_reads_its_config(tmp_path, capsys, family):
    directory = tmp_path / "model"
    init = ["init-model", str(directory), "--tokenizer", "letters", "--family", family]
    assert main(init) == 0
    capsys.readouterr()
    plan = [
        "plan",
        "arithmetic",
        "--model.base_model",
        str(directory),
        "--rl.prompts_per_step",
        "1",
    ]
    assert main(plan) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{directory} (0.")
    assert "generator weights: the trainer's own (no copy)" in out
