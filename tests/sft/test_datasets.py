"""JSONL conversations: validation with file and line, splits, and a restorable epoch stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from temper.sft.datasets import (
    ConversationDataset,
    DataPosition,
    EpochStream,
    load_conversations,
    split_conversations,
)

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
SAMPLE = Path(__file__).resolve().parents[2] / "data" / "conversations_sample.jsonl"


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_loads_conversations_and_skips_blank_lines(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD), "", json.dumps(GOOD)])
    conversations = load_conversations(path)
    assert [c.where for c in conversations] == [f"{path}:1", f"{path}:3"]
    assert list(conversations[0].messages) == GOOD["messages"]


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.jsonl"):
        load_conversations(tmp_path / "nowhere.jsonl")


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"messages": [', "malformed JSON"),
        ('["not", "an", "object"]', 'expected an object with a "messages" list'),
        ('{"turns": []}', 'expected an object with a "messages" list'),
        ('{"messages": []}', '"messages" must be a non-empty list'),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role 'robot' is not one of"),
        ('{"messages": [{"role": "user", "content": 5}]}', "content must be a string"),
        ('{"messages": [{"role": "user", "text": "x"}]}', r"message 0 is missing \['content'\]"),
        ('{"messages": [{"content": "x"}]}', r"message 0 is missing \['role'\]"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
    ],
)
def test_bad_lines_are_errors_naming_file_and_line(tmp_path, bad_line, message):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD), "", bad_line, json.dumps(GOOD)])
    with pytest.raises(ValueError, match=rf"d\.jsonl:3: .*{message}"):
        load_conversations(path)


def test_a_conversation_spread_over_lines_is_an_error_saying_so(tmp_path):
    # The pretty-printed layout of docs/sft.md's example, pasted as is.
    pretty = json.dumps(GOOD, indent=2).splitlines()
    with pytest.raises(ValueError, match=r"d\.jsonl:1: .*must be a whole JSON object on one line"):
        load_conversations(write_lines(tmp_path / "d.jsonl", pretty))
    # An error inside a line still names its column.
    with pytest.raises(ValueError, match=r"d\.jsonl:1: malformed JSON \(Expecting .* column 2\)"):
        load_conversations(write_lines(tmp_path / "d.jsonl", ["{x: 1}"]))


def test_empty_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="holds no conversations"):
        load_conversations(write_lines(tmp_path / "d.jsonl", [""]))


def test_split_is_seeded_disjoint_and_complete(tmp_path):
    lines = [json.dumps({**GOOD, "id": i}) for i in range(50)]
    conversations = load_conversations(write_lines(tmp_path / "d.jsonl", lines))
    split = split_conversations(conversations, heldout_fraction=0.2, seed=3)
    again = split_conversations(conversations, heldout_fraction=0.2, seed=3)
    other = split_conversations(conversations, heldout_fraction=0.2, seed=4)
    assert len(split.heldout) == 10 and len(split.train) == 40
    assert {c.where for c in split.heldout} | {c.where for c in split.train} == {
        c.where for c in conversations
    }
    assert split.heldout == again.heldout and split.heldout != other.heldout


def test_dataset_config_with_a_separate_heldout_file(tmp_path):
    train = write_lines(tmp_path / "train.jsonl", [json.dumps(GOOD)] * 3)
    heldout = write_lines(tmp_path / "heldout.jsonl", [json.dumps(GOOD)])
    dataset = ConversationDataset.Config(path=str(train), heldout_path=str(heldout)).build()
    assert (len(dataset.train), len(dataset.heldout)) == (3, 1)
    with pytest.raises(ValueError, match="path is empty"):
        ConversationDataset.Config().build()
    with pytest.raises(ValueError, match=r"heldout_fraction must be in \(0, 1\), got 1.5"):
        ConversationDataset.Config(path=str(train), heldout_fraction=1.5)


def test_epoch_stream_covers_each_epoch_and_restores_from_two_ints():
    stream = EpochStream(5, seed=1)
    first = stream.take(3) + stream.take(2)
    assert sorted(first) == list(range(5))
    assert stream.position == DataPosition(epoch=1, index=0)
    taken = stream.take(7)
    assert sorted(taken[:5]) == list(range(5)) and taken[:5] != first
    position = stream.position
    assert (position.epoch, position.index) == (2, 2)
    resumed = EpochStream(5, seed=1, position=DataPosition(epoch=2, index=2))
    assert resumed.take(9) == stream.take(9)
    with pytest.raises(ValueError, match="outside a dataset of 5 items"):
        EpochStream(5, seed=1, position=DataPosition(epoch=0, index=5))


def test_sample_dataset_is_valid():
    conversations = load_conversations(SAMPLE)
    assert 100 <= len(conversations) <= 300
