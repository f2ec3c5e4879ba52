"""`temper plan` through the real entry point, and the plans printed in docs/distributed.md."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from temper.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
_PLAN_AND_OUTPUT = re.compile(r"```bash\n(temper plan [^`]*?)\n```\n\n```text\n(.*?)\n```", re.S)

SPLIT = ["--model", "8B", "--nnodes", "2", "--nproc-per-node", "8", "--lora-rank", "32"]
SPLIT += ["--placement", "disaggregated", "--generator-ranks", "4", "--max-seq-len", "1024"]


def test_plan_prints_a_table_per_role_and_whether_it_fits(capsys):
    assert main(["plan", *SPLIT]) == 0
    out = capsys.readouterr().out
    assert "trainer: 12 trainer ranks (FSDP over 12)" in out
    assert "generator: 4 generator ranks (4 engines)" in out
    assert "| KV cache: 64 slots x 1024 tokens" in out
    assert "| peak while training " in out and "| peak at weight sync " in out
    assert out.rstrip().splitlines()[-1].startswith("fits: trainer peaks at")


def test_plan_says_when_it_does_not_fit(capsys):
    assert main(["plan", "--model", "32B", "--nproc-per-node", "16", "--lora-rank", "32"]) == 0
    assert "DOES NOT FIT: colocated peaks at" in capsys.readouterr().out


def test_bad_settings_are_a_clean_error_naming_the_field(capsys):
    split = ["plan", "--model", "8B", "--placement", "disaggregated"]
    assert main([*split, "--generator-ranks", "8"]) == 2
    err = capsys.readouterr().err
    assert "temper plan: error: generator_ranks=8 must be in 1..7" in err
    assert "Traceback" not in err


def test_disaggregated_has_one_generator_rank_unless_told(capsys):
    # As in `temper train`, whose --placement.generator_ranks defaults to 1.
    assert main(["plan", "--model", "8B", "--placement", "disaggregated"]) == 0
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


def test_plan_of_a_model_directory_reads_its_config(tmp_path, capsys):
    directory = tmp_path / "model"
    assert main(["init-model", str(directory), "--tokenizer", "letters"]) == 0
    capsys.readouterr()
    assert main(["plan", "--model", str(directory), "--nproc-per-node", "1", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{directory} (0.")
    assert "generator weights: the trainer's own (no copy)" in out
