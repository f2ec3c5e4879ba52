"""Paths typed relative to where a run starts are saved by their absolute paths."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from temper.config.cli import parse_train_argv
from temper.config.local_paths import LOCAL_PATH, make_local_paths_absolute


@dataclasses.dataclass(kw_only=True)
class Data:
    path: str = dataclasses.field(default="", metadata=LOCAL_PATH)
    note: str = "data.jsonl"


@dataclasses.dataclass(kw_only=True)
class Job:
    model: str | None = dataclasses.field(default=None, metadata=LOCAL_PATH)
    data: Data = dataclasses.field(default_factory=Data)
    more: list[Data] = dataclasses.field(default_factory=list)


def test_an_existing_relative_path_becomes_absolute_and_nothing_else_changes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text("{}\n")
    (tmp_path / "model").mkdir()
    job = Job(model="model", data=Data(path="data.jsonl"), more=[Data(path="./data.jsonl")])
    make_local_paths_absolute(job)
    assert job.model == str(tmp_path / "model")
    assert job.data.path == job.more[0].path == str(tmp_path / "data.jsonl")
    assert job.data.note == "data.jsonl"  # not a path field


@pytest.mark.parametrize("value", ["tiny", "missing.jsonl", "", "/abs/missing.jsonl"])
def test_a_value_naming_nothing_on_disk_stays_as_typed(
    value: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    job = Job(model=value, data=Data(path=value))
    make_local_paths_absolute(job)
    assert (job.model, job.data.path) == (value, value)


def test_temper_train_resolves_a_relative_dataset_and_model_directory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What config.json then holds, so `--config-file` and `--resume` work from anywhere.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.jsonl").write_text("{}\n")
    (tmp_path / "base").mkdir()
    args = ["sft_conversations", "--conversations.path", "mine.jsonl"]
    invocation = parse_train_argv([*args, "--model.base_model", "base"])
    assert invocation.config.conversations.path == str(tmp_path / "mine.jsonl")
    assert invocation.config.model.base_model == str(tmp_path / "base")
    assert parse_train_argv(args).config.model.base_model == "tiny:words"  # a named size
