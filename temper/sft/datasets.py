"""JSONL conversation datasets: loaded and validated whole, split, and streamed in epochs.

A dataset file holds one conversation per line:

    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}

Everything is checked at load (through the shared JSONL reader, temper/tasks/jsonl.py), before
any training starts: a missing file is a FileNotFoundError naming the path; malformed JSON, a
missing or empty "messages" list, a bad role or content, or a conversation without an
assistant message is a ValueError naming the file and line. Blank lines are skipped (and still
counted for line numbers).

`EpochStream` yields the training conversations in a seeded shuffled order, a new order each
epoch; its position is two plain ints (epoch, index), so a resumed run continues exactly.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from temper.config.checks import check_range
from temper.config.configurable import Configurable
from temper.config.local_paths import LOCAL_PATH
from temper.tasks.jsonl import JsonLine, read_jsonl
from temper.tokenizer.renderers import Message, RendererName, TrainOn, check_messages


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    where: str
    """"path:line" of the conversation, for error messages."""


def load_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation in the JSONL file at `path`, validated (see the module doc)."""
    return read_jsonl(
        path,
        _parse_line,
        name="conversation dataset",
        expected='a JSONL file with one {"messages": [...]} object per line',
        items="conversations",
    )


def _parse_line(line: JsonLine) -> Conversation:
    where, record = line.where, line.value
    if not isinstance(record, dict) or "messages" not in record:
        raise ValueError(f'{where}: expected an object with a "messages" list')
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'{where}: "messages" must be a non-empty list of messages')
    try:
        check_messages(messages)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError(f"{where}: the conversation has no assistant message to train on")
    return Conversation(
        messages=tuple({"role": m["role"], "content": m["content"]} for m in messages),
        where=where,
    )


@dataclass(frozen=True)
class DatasetSplit:
    train: list[Conversation]
    heldout: list[Conversation]


def split_conversations(
    conversations: Sequence[Conversation], *, heldout_fraction: float, seed: int
) -> DatasetSplit:
    """A seeded random `heldout_fraction` of the conversations (at least one) is held out."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if len(conversations) < 2:
        raise ValueError(
            f"cannot hold out part of {len(conversations)} conversation(s); give a separate "
            "held-out file (--conversations.heldout_path) or more conversations"
        )
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    num_heldout = min(len(order) - 1, max(1, round(heldout_fraction * len(order))))
    heldout = sorted(order[:num_heldout])
    train = sorted(order[num_heldout:])
    return DatasetSplit(
        train=[conversations[i] for i in train], heldout=[conversations[i] for i in heldout]
    )


class ConversationDataset(Configurable):
    """A JSONL conversation file split into training and held-out conversations."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        path: str = field(default="", metadata=LOCAL_PATH)
        """JSONL file of conversations, one {"messages": [...]} object per line."""
        heldout_path: str | None = field(default=None, metadata=LOCAL_PATH)
        """A separate JSONL file of held-out conversations; None holds out part of `path`."""
        heldout_fraction: float = 0.1
        """Share of `path` held out when there is no `heldout_path`, in (0, 1)."""
        split_seed: int = 0
        """Seed of the held-out split (kept apart from the run's seed, so runs with other
        seeds evaluate on the same conversations)."""
        renderer: RendererName = "role_colon"
        """Chat format: role_colon (plain text, any tokenizer), qwen3, qwen3_no_think, or
        qwen3_5 (Qwen3.5 / Qwen3.6), qwen3_5_disable_thinking, qwen3_5_preserve_thinking."""
        train_on: TrainOn = "all_assistant"
        """Assistant messages trained on: all_assistant or last_assistant."""

        def __post_init__(self) -> None:
            check_range(
                self.heldout_fraction,
                field="ConversationDataset.Config.heldout_fraction",
                greater_than=0,
                less_than=1,
            )

    def __init__(self, config: Config) -> None:
        self.config = config
        if not config.path:
            raise ValueError(
                "ConversationDataset.Config.path is empty; set it to a JSONL conversation file "
                "(e.g. --conversations.path data/conversations_sample.jsonl)"
            )
        conversations = load_conversations(config.path)
        if config.heldout_path is None:
            split = split_conversations(
                conversations, heldout_fraction=config.heldout_fraction, seed=config.split_seed
            )
        else:
            split = DatasetSplit(
                train=conversations, heldout=load_conversations(config.heldout_path)
            )
        self.train, self.heldout = split.train, split.heldout


@dataclass(frozen=True)
class DataPosition:
    epoch: int
    """Completed passes over the training set."""
    index: int
    """Items of the current epoch already taken."""


class EpochStream:
    """Items of a fixed list in a seeded shuffled order, reshuffled every epoch.

    The order of epoch e depends only on (seed, e), so `DataPosition` alone restores it.
    """

    def __init__(self, num_items: int, *, seed: int, position: DataPosition | None = None) -> None:
        assert num_items > 0
        self.num_items = num_items
        self.seed = seed
        self.position = position or DataPosition(epoch=0, index=0)
        if not 0 <= self.position.index < num_items or self.position.epoch < 0:
            raise ValueError(
                f"data position {self.position} is outside a dataset of {num_items} items"
            )

    def take(self, count: int) -> list[int]:
        """The next `count` item indices (crossing into the next epoch when needed)."""
        taken = []
        epoch, index = self.position.epoch, self.position.index
        order = self._order(epoch)
        while len(taken) < count:
            taken.append(order[index])
            index += 1
            if index == self.num_items:
                epoch, index = epoch + 1, 0
                order = self._order(epoch)
        self.position = DataPosition(epoch=epoch, index=index)
        return taken

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.num_items))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order
