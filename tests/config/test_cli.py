"""The `temper` command line, driven in-process through main(argv).

The dummy root config and its recipe live in this module and are selected with the spec
f"{__name__}:dummy_recipe", which works however pytest named this module.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Literal

import pytest

from temper.checkpoint.run_state import RunState, save_run_state
from temper.cli import function_command, main
from temper.config import Configurable, config_to_dict, load_config, serialize
from temper.config.cli import check_root_config

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


class DummyModel(Configurable):
    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        width: int = 8
        """Hidden width of the dummy model."""
        dropout: float = 0.0
        """Dropout probability, applied after every
        block of the dummy model."""


class DummyAdam(Configurable):
    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        learning_rate: float = 1e-3
        """Step size."""


class DummySgd(Configurable):
    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        learning_rate: float = 0.1
        """Step size."""
        momentum: float = 0.0
        """Momentum factor."""


class Precision(enum.StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"


class DummyJob(Configurable):
    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        model: DummyModel.Config = dataclasses.field(default_factory=DummyModel.Config)
        """Model settings."""
        optimizer: DummyAdam.Config | DummySgd.Config = dataclasses.field(
            default_factory=DummyAdam.Config
        )
        """Optimizer settings."""
        precision: Precision = Precision.FP32
        """Numeric precision."""
        mode: Literal["fast", "slow"] = "fast"
        """How the dummy job runs."""
        num_steps: int = 3
        """Number of dummy steps."""
        shape: tuple[int, ...] = (2, 2)
        """Shape of nothing in particular."""
        init_from: pathlib.Path | None = None
        """Checkpoint to start from."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def run(self, *, run_dir: pathlib.Path) -> None:
        (run_dir / "ran.json").write_text(json.dumps(config_to_dict(self.config)))


def dummy_recipe() -> DummyJob.Config:
    """Dummy run for CLI tests."""
    return DummyJob.Config(num_steps=5)


SPEC = f"{__name__}:dummy_recipe"


class InterruptedJob(Configurable):
    """A job stopped by Ctrl-C after writing its first file."""

    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        num_steps: int = 3
        """Number of dummy steps."""
        checkpointed: bool = True
        """Save a run state (what --resume needs) before the interrupt."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def run(self, *, run_dir: pathlib.Path, resume: bool = False) -> None:
        (run_dir / "started").write_text("")
        if self.config.checkpointed:
            save_run_state(run_dir, RunState(step=1, train_state="tinker://r/weights/s", loop={}))
        raise KeyboardInterrupt


class FailingStartJob(Configurable):
    """A job whose training client claimed a run (run.json) before bad input stopped it."""

    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        num_steps: int = 3
        """Number of dummy steps."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def run(self, *, run_dir: pathlib.Path, resume: bool = False) -> None:
        claimed = run_dir / "checkpoints" / "run-1"
        claimed.mkdir(parents=True)
        (claimed / "run.json").write_text("{}")
        raise ValueError("task.path: no such file")


def failing_start_recipe() -> FailingStartJob.Config:
    """A run that fails at startup."""
    return FailingStartJob.Config()


def interrupted_recipe() -> InterruptedJob.Config:
    """A run interrupted with Ctrl-C."""
    return InterruptedJob.Config()


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # tyro wraps help text to the terminal width; keep docstrings on one line.
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture
def recipe_package(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A throwaway recipes package with a default recipe building DummyJob."""
    name = f"recipes_{uuid.uuid4().hex[:8]}"
    (tmp_path / "pkgs" / name).mkdir(parents=True)
    (tmp_path / "pkgs" / name / "__init__.py").write_text("")
    (tmp_path / "pkgs" / name / "runs.py").write_text(
        f"from temper.config import recipe\nfrom {__name__} import DummyJob\n\n"
        '@recipe("The default dummy run.", default=True)\n'
        "def dummy_default():\n    return DummyJob.Config(num_steps=11)\n\n"
        '@recipe("A wide dummy run.")\n'
        "def dummy_wide():\n    return DummyJob.Config(num_steps=1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    yield name
    for module in [m for m in sys.modules if m.split(".")[0] == name]:
        del sys.modules[module]


def test_train_applies_typed_overrides_saves_config_and_runs(tmp_path: pathlib.Path) -> None:
    run_dir = tmp_path / "run"
    overrides = "--num_steps 7 --model.dropout 0.5 --shape 1 2 3 --mode slow --init_from ckpt/a"
    argv = ["train", SPEC, "--run-dir", str(run_dir), *overrides.split()]
    assert main(argv) == 0
    expected = DummyJob.Config(
        model=DummyModel.Config(dropout=0.5),
        mode="slow",
        num_steps=7,
        shape=(1, 2, 3),
        init_from=pathlib.Path("ckpt/a"),
    )
    loaded = load_config(run_dir / "config.json")
    assert loaded.recipe == SPEC
    assert loaded.config == expected
    assert json.loads((run_dir / "ran.json").read_text()) == config_to_dict(expected)


def test_help_shows_field_docstrings_and_train_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", SPEC, "--help"]) == 0
    out = capsys.readouterr().out
    for text in [
        "--model.width",
        "Hidden width of the dummy model.",
        "Number of dummy steps.",
        "--config-file",
        "--run-dir",
    ]:
        assert text in out
    # The multi-node example is a shell command continued on a second line, as typed.
    assert re.search(r"--nproc-per-node 8 \\\n +--rdzv-endpoint NODE0_HOST:29500", out), out


def test_unknown_field_fails_naming_it(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", SPEC, "--run-dir", str(run_dir), "--model.widht", "3"]) == 2
    err = capsys.readouterr().err
    assert "--model.widht" in err
    assert "--model.width INT" in err  # tyro's suggestion, with the expected type
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--num_steps", "many", "INT"),
        ("--model.dropout", "x", "FLOAT"),
        ("--mode", "medium", "'fast', 'slow'"),
    ],
)
def test_wrong_type_fails_naming_field_and_type(
    flag: str, value: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", SPEC, flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err
    assert expected in err


def test_union_of_configs_is_a_subcommand_named_after_the_owner(tmp_path: pathlib.Path) -> None:
    run_dir = tmp_path / "run"
    argv = ["--precision", "bf16", "optimizer:dummy-sgd", "--optimizer.momentum", "0.5"]
    assert main(["train", SPEC, "--run-dir", str(run_dir), *argv]) == 0
    config = load_config(run_dir / "config.json").config
    assert config.optimizer == DummySgd.Config(momentum=0.5)
    assert config.precision is Precision.BF16


def test_root_flags_may_follow_a_subcommand_and_its_flags_select_the_default(
    tmp_path: pathlib.Path,
) -> None:
    argv = ["optimizer:dummy-sgd", "--optimizer.momentum", "0.5", "--num_steps", "9"]
    assert main(["train", SPEC, "--run-dir", str(tmp_path / "a"), *argv]) == 0
    config = load_config(tmp_path / "a" / "config.json").config
    assert config.optimizer == DummySgd.Config(momentum=0.5) and config.num_steps == 9
    # A member's flag without its subcommand applies to the default member.
    argv = ["--optimizer.learning_rate", "0.5", "--mode", "slow"]
    assert main(["train", SPEC, "--run-dir", str(tmp_path / "b"), *argv]) == 0
    config = load_config(tmp_path / "b" / "config.json").config
    assert config.optimizer == DummyAdam.Config(learning_rate=0.5) and config.mode == "slow"


def test_help_joins_the_lines_of_a_field_docstring(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", SPEC, "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # One line at this width, not broken where the docstring's source line ends.
    assert any(
        "Dropout probability, applied after every block of the dummy model." in line
        for line in lines
    )


def test_ctrl_c_says_how_to_resume_instead_of_a_traceback(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", f"{__name__}:interrupted_recipe", "--run-dir", str(run_dir)]) == 130
    assert f"interrupted; `temper train --resume {run_dir}`" in capsys.readouterr().err
    assert (run_dir / "started").exists()  # the run directory is kept for --resume
    assert main(["train", "--resume", str(run_dir)]) == 130
    assert f"--resume {run_dir}" in capsys.readouterr().err


def test_ctrl_c_before_any_checkpoint_says_there_is_nothing_to_resume(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", f"{__name__}:interrupted_recipe", "--run-dir", str(run_dir)]
    assert main([*argv, "--checkpointed", "False"]) == 130
    err = capsys.readouterr().err
    assert "no full-state checkpoint was saved yet, so there is nothing to resume" in err
    assert "--resume" not in err
    # Rerunning into that directory says it cannot be resumed (instead of suggesting it).
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "it holds no checkpoint to resume" in err and "--resume" not in err


def test_config_file_reproduces_run_and_accepts_overrides(tmp_path: pathlib.Path) -> None:
    first, second, third = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert main(["train", SPEC, "--run-dir", str(first), "--model.width", "64"]) == 0
    saved = load_config(first / "config.json")
    assert (
        main(["train", "--config-file", str(first / "config.json"), "--run-dir", str(second)]) == 0
    )
    assert load_config(second / "config.json") == saved
    config_file = first / "config.json"
    argv = ["train", f"--config-file={config_file}", f"--run-dir={third}", "--num_steps", "9"]
    assert main(argv) == 0
    again = load_config(third / "config.json")
    assert again.config == dataclasses.replace(saved.config, num_steps=9)
    assert again.recipe == SPEC


OWN_OPTIMIZER_RECIPE = f"""
import dataclasses

from temper.config import Configurable
from {__name__} import DummyJob


class Lion(Configurable):
    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        learning_rate: float = 1e-4
        \"\"\"Step size.\"\"\"


def mine():
    return DummyJob.Config(optimizer=Lion.Config())
"""


def test_a_recipe_files_own_class_in_a_union_field_reruns_from_config_json(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Like your own task or env source in the RL job's `task`/`env`: a class the union does not
    # name is saved with its class, and loads back once the run's recipe file is imported.
    # DummyJob stands for RLJob, whose package (temper) config.json may import.
    monkeypatch.setattr(serialize, "TRUSTED_PACKAGES", (*serialize.TRUSTED_PACKAGES, "tests"))
    recipe_file = tmp_path / "my_recipes.py"
    recipe_file.write_text(OWN_OPTIMIZER_RECIPE)
    first, second = tmp_path / "a", tmp_path / "b"
    argv = ["train", f"{recipe_file}:mine", "--run-dir", str(first)]
    assert main([*argv, "--optimizer.learning_rate", "0.5"]) == 0
    saved = json.loads((first / "config.json").read_text())["config"]["optimizer"]
    (module,) = [m for m in sys.modules if m.startswith("temper_recipe_file_my_recipes_")]
    assert saved == {"__config_class__": f"{module}:Lion.Config", "learning_rate": 0.5}
    del sys.modules[module]  # as in a new process: --config-file imports the recipe file again
    argv = ["train", "--config-file", str(first / "config.json"), "--run-dir", str(second)]
    assert main(argv) == 0
    assert json.loads((second / "ran.json").read_text())["optimizer"] == saved  # a Lion again
    del sys.modules[module]


def test_default_run_dir_is_under_runs(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", SPEC]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"dummy_recipe-\d{8}-\d{6}", run_dir.name)
    assert sorted(path.name for path in run_dir.iterdir()) == ["config.json", "ran.json"]


def test_non_empty_run_dir_is_refused(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "old").write_text("results of an earlier run")
    assert main(["train", SPEC, "--run-dir", str(tmp_path)]) == 2
    assert f"--run-dir {tmp_path} already exists and is not empty" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", SPEC, "--run-dir", str(empty)]) == 0


def test_default_recipe_is_used_without_a_name(
    recipe_package: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--run-dir", str(tmp_path / "run")], recipe_package=recipe_package) == 0
    document = json.loads((tmp_path / "run" / "config.json").read_text())
    assert document["recipe"] == "dummy_default"
    assert document["config"]["num_steps"] == 11
    assert main(["train", "--help"], recipe_package=recipe_package) == 0
    assert "(default: 11)" in capsys.readouterr().out


def test_unknown_recipe_lists_known_names(
    recipe_package: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "dummy_wdie"], recipe_package=recipe_package) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'dummy_wdie'" in err
    assert "did you mean 'dummy_wide'?" in err
    assert "dummy_default, dummy_wide" in err


def test_bad_train_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", SPEC, "--config-file", "x/config.json"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["train", "--config-file", "x/config.json"]) == 2
    assert "--config-file x/config.json: no such file" in capsys.readouterr().err
    assert main(["train", SPEC, "--run-dir"]) == 2
    assert "--run-dir needs a value" in capsys.readouterr().err


def test_recipes_command_prints_table(
    recipe_package: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["recipes"], recipe_package=recipe_package) == 0
    out = capsys.readouterr().out
    assert re.search(r"dummy_default\s+.*The default dummy run\. \(default\)", out)
    assert re.search(r"dummy_wide\s+.*A wide dummy run\.", out)


def test_top_level_help_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"train\s+Train from a recipe", out)
    assert re.search(r"recipes\s+List the registered recipes", out)
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err
    assert "valid commands: train, recipes" in err
    assert main([]) == 2


def test_top_level_help_gives_each_command_its_whole_first_paragraph(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # `plan`'s first paragraph runs over two lines: all of it is shown, wrapped.
    assert "Print the GPU memory each rank of a recipe's RL job would hold" in out
    assert "flags override the recipe's fields as in `train`." in out


def test_function_command_parses_keyword_only_flags(capsys: pytest.CaptureFixture[str]) -> None:
    def echo(*, text: str, times: int = 1) -> int:
        """Print text several times."""
        print(text * times)
        return 3

    command = function_command(echo, name="echo")
    assert command.description == "Print text several times."
    assert command.run(["--text", "ab", "--times", "2"]) == 3
    assert capsys.readouterr().out == "abab\n"
    assert command.run(["--times", "2"]) == 2  # --text is required


def test_python_dash_m_temper_recipes() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, "-m", "temper", "recipes"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "name" in result.stdout
    assert "description" in result.stdout


def test_a_run_that_fails_at_startup_leaves_no_directory_behind(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", f"{__name__}:failing_start_recipe", "--run-dir", str(run_dir)]
    assert main(argv) == 1
    assert "task.path: no such file" in capsys.readouterr().err
    assert not run_dir.exists()  # so the same command works once the input is fixed


def test_a_config_outside_a_job_class_is_refused_naming_the_job_config() -> None:
    # What a recipe returns when it builds a settings class that no job owns (one of a job's
    # parts) instead of the job's own config (RLJob.Config): a config with no owner to run.
    @dataclasses.dataclass(kw_only=True)
    class Loose(Configurable.Config):
        steps: int = 1

    with pytest.raises(TypeError, match=r"not nested in a job class .*e\.g\. RLJob\.Config"):
        check_root_config(Loose(), recipe="my_recipes.py:mine")
