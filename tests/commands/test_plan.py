"""`temper plan RECIPE` through the real entry point, and the plans printed in
docs/distributed.md."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from temper.cli import main
from temper.job.memory_report import format_bytes

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
    # The recipe's 256 KV-cache slots per engine and an 8192-token micro-batch without
    # activation checkpointing do not fit an 80 GiB GPU: exit status 1.
    assert main(["plan", *RECIPE, "--nproc", "8"]) == 1
    recipe = capsys.readouterr().out
    assert recipe.startswith("8B (8.19B parameters), LoRA rank 32, bf16-mixed; 1 x 8 ranks")
    assert "batch 256 x 1024 tokens" in recipe  # 32 prompts x 8, the sampler's max_seq_len
    assert "| KV cache: 256 slots x 1024 tokens" in recipe  # the recipe's sampler.max_batch
    overrides = ["--model.lora_rank", "8", "--rl.group_size", "4", "--sampler.max_seq_len", "512"]
    assert main(["plan", *RECIPE, "--nproc", "8", *overrides]) == 1
    changed = capsys.readouterr().out
    assert "LoRA rank 8" in changed and "batch 128 x 512 tokens" in changed


def test_plan_says_when_it_does_not_fit_and_exits_with_1(capsys):
    assert main(["plan", "gsm8k_qwen3_0_6b", "--model.base_model", "32B", "--nproc", "16"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT: colocated peaks at" in out
    assert out.rstrip().splitlines()[-1].startswith("colocated: over by ")


def test_bad_settings_are_a_clean_error_naming_the_field(capsys):
    split = ["plan", *RECIPE, "--nproc", "8", "--placement.mode", "disaggregated"]
    assert main([*split, "--placement.generator_ranks", "8"]) == 2
    err = capsys.readouterr().err
    assert "temper plan: error: Placement.Config.generator_ranks=8 leaves no trainer rank" in err
    assert "Traceback" not in err


def test_a_model_that_is_neither_a_size_nor_a_directory_names_its_flag(capsys):
    assert main(["plan", "gsm8k_qwen3_0_6b", "--model.base_model", "3B"]) == 2
    err = capsys.readouterr().err
    assert "temper plan: error: --model.base_model: model '3B' is neither a model" in err
    # Llama's 3B is a valid name: the error lists it.
    assert "meta-llama/Llama-3.2-3B" in err and "llama: tiny, 1B, 3B, 8B, 70B" in err


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
    assert len(_documented_plans()) == 7


@pytest.mark.parametrize(("command", "output"), _documented_plans())
def test_documented_plans_are_the_commands_output(command, output, capsys):
    argv = shlex.split(command.replace("\\\n", " "))
    assert main(argv[1:]) == (1 if "DOES NOT FIT" in output else 0)
    assert capsys.readouterr().out.rstrip("\n") == output, (
        f"docs/distributed.md shows an outdated plan for `{command}`; paste its output again"
    )


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
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
    assert re.match(rf"{re.escape(str(directory))} \(\d+\.\d\dM parameters", out)
    assert "generator weights: the trainer's own (no copy)" in out
    moe = family == "qwen3_moe"
    assert ("M active)" in out.splitlines()[0]) == moe
    assert ("| weights: routed experts, float32 " in out) == moe


FULL_8_GPUS = ["gsm8k_qwen3_0_6b", "--model.lora_rank", "None", "--nproc", "8"]


@pytest.mark.parametrize(
    ("name", "parameters"),
    [
        ("Qwen/Qwen3-8B", "8.19B parameters"),
        ("meta-llama/Llama-3.1-8B", "8.03B parameters"),
        ("llama/8B", "8.03B parameters"),
        ("Qwen/Qwen3-30B-A3B", "30.53B parameters, 3.35B active"),
        ("qwen3_moe/235B-A22B", "235.09B parameters, 22.19B active"),
    ],
)
def test_plan_of_named_models_of_every_family(name, parameters, capsys):
    assert main(["plan", *FULL_8_GPUS, "--model.base_model", name]) in (0, 1)  # fits or not
    out = capsys.readouterr().out
    assert out.startswith(f"{name} ({parameters}), full, bf16-mixed; 1 x 8 ranks")


def _cell(out: str, item: str) -> str:
    """The 'per rank' cell of the table row whose item is `item`."""
    (line,) = [line for line in out.splitlines() if line.startswith(f"| {item} ")]
    return line.split("|")[3].strip()


def test_a_moe_plan_shows_the_experts_bytes_per_rank(capsys):
    """Qwen3-30B-A3B's 48 x 128 experts of 3 x 2048 x 768: 16 per rank over 8 FSDP ranks, in
    fp32 master weights; each generator holds all of them in bf16."""
    assert main(["plan", *FULL_8_GPUS, "--model.base_model", "Qwen/Qwen3-30B-A3B"]) == 1
    out = capsys.readouterr().out
    experts = 48 * 128 * 3 * 2048 * 768
    trainer = _cell(out, "weights: routed experts, 1/8 of float32 (master)")
    assert trainer == format_bytes(experts // 8 * 4) == "13.50 GiB"
    generator = _cell(out, "generator weights: routed experts, whole bfloat16")
    assert generator == format_bytes(experts * 2) == "54.00 GiB"


def _rows(text: str) -> list[tuple[str, str, str]]:
    """(model, item, bytes) of each row of the plan's tables in `text`."""
    cells = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| /")
    ]
    return [(model, item, held) for model, item, held, _ in cells]


def test_plan_serve_says_what_a_trainer_and_a_generator_rank_hold(tmp_path, capsys):
    from temper.checkpoint.model_source import init_model_dir
    from temper.server import TemperServer
    from temper.server.state.base_models import load_base_model

    student, grader = tmp_path / "student", tmp_path / "grader"
    for seed, directory in enumerate((student, grader)):
        init_model_dir(directory, size="tiny", tokenizer="digits", seed=seed)
    models = ["--model", str(student), "--sample-only-model", str(grader)]
    placement = ["--nproc", "3", "--placement.mode", "disaggregated"]
    placement += ["--placement.generator_ranks", "2", "--lora-rank", "8"]
    assert main(["plan", "serve", *models, "--model-memory-mb", "400", *placement]) == 0
    out = capsys.readouterr().out
    assert "trainer ranks: 1 (FSDP over 1); budget 400.0 MiB a rank" in out
    assert "generator ranks: 2; budget 400.0 MiB a rank" in out
    # The estimates the server's budgets count: a trainer rank holds the shard alone.
    config = TemperServer.Config(model=[str(student)])
    base = load_base_model(str(student), trainable=True, sampler=config.sampler, dtype=config.dtype)
    trainer, generator = (_rows(part) for part in out.split("generator ranks:"))
    shard = base.training_bytes(
        lora_rank=8, shared_base=False, sampler_reads_trainer=False, sampler=False
    )
    assert trainer == [
        (str(student), "each LoRA training model, rank 8: its shard", format_bytes(shard))
    ]
    sampler = format_bytes(base.sampler_bytes)  # the grader has the student's shapes
    assert generator == [
        (str(student), "sampler: weights, KV cache, prefix cache", sampler),
        (str(grader), "sampler: weights, KV cache, prefix cache (sample-only)", sampler),
        (
            str(student),
            "each LoRA snapshot: its adapters, rank 8 (on the sampler above)",
            format_bytes(8 * base.lora_bytes_per_rank),
        ),
    ]
    # A budget no rank's sampler fits: the server would answer 503, the plan exits 1.
    assert main(["plan", "serve", *models, "--model-memory-mb", "100", *placement]) == 1
    verdict = capsys.readouterr().out.rpartition("verdict: ")[2]
    assert verdict.startswith(f"does NOT fit (the server answers 503 for what does not): {student}")
    assert f"sampler needs {sampler}; raise --model-memory-mb to at least" in verdict
    bad = ["--nproc", "3", "--placement.mode", "disaggregated", "--placement.generator_ranks", "3"]
    assert main(["plan", "serve", *models, *bad]) == 2
    assert "--placement.generator_ranks 3" in capsys.readouterr().err
