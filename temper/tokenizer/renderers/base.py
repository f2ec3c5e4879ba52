"""What a renderer is: a conversation in, token ids and per-token loss weights out.

A conversation is a list of messages, each `{"role": ..., "content": ...}` with role one of
`system`, `user`, `assistant`. Renderers turn it into token ids by encoding each piece of the
format separately and concatenating the ids (never by re-tokenizing the joined text), so the
weight of every token is known exactly: 1 on the content of the assistant messages trained on
and on the marker that ends each of them, 0 elsewhere (role headers, other messages, the
separators between messages).

`WeightedTokens.weights[i]` is the weight of predicting `tokens[i]`; the first token has no
prediction, and the formats here never put assistant content first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from temper.tokenizer.tokenizer import Tokenizer

Role = Literal["system", "user", "assistant"]
ROLES: tuple[str, ...] = ("system", "user", "assistant")

TrainOn = Literal["all_assistant", "last_assistant"]
"""Which assistant messages get weight 1: every one, or only the last of the conversation."""

Message = Mapping[str, str]
"""{"role": "system" | "user" | "assistant", "content": str}; the qwen3_5 renderers also take
role "tool" and an assistant message's "tool_calls" (see qwen3_5.py)."""


@dataclass(frozen=True)
class WeightedTokens:
    tokens: list[int]
    weights: list[float]
    """Loss weight of each token, the same length as `tokens`."""

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.weights), (len(self.tokens), len(self.weights))

    @property
    def num_weighted(self) -> int:
        return sum(1 for weight in self.weights if weight > 0)


class Renderer(Protocol):
    """A chat format over one tokenizer."""

    name: str
    chat_template: str | None
    """This format as a Jinja chat template, which a model directory trained on it carries;
    None: the format is the tokenizer's own template (a model family's chat format)."""

    def render(self, messages: Sequence[Message], *, train_on: TrainOn) -> WeightedTokens:
        """The whole conversation, with weight 1 on the assistant messages trained on."""
        ...

    def generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        """The conversation so far followed by the header of a new assistant message."""
        ...

    @property
    def stop(self) -> list[int] | list[str]:
        """Stop token ids or stop strings for `SamplingParams.stop` when sampling a reply."""
        ...

    def parse_response(self, tokens: Sequence[int]) -> str:
        """The assistant content of sampled reply tokens (up to the end marker)."""
        ...


class Segments:
    """Token ids built piece by piece, each piece with one loss weight."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.weights: list[float] = []

    def add_text(self, text: str, *, weight: float) -> None:
        if text:
            self.add_ids(self.tokenizer.encode(text), weight=weight)

    def add_ids(self, ids: Sequence[int], *, weight: float) -> None:
        self.tokens.extend(ids)
        self.weights.extend([weight] * len(ids))

    def result(self) -> WeightedTokens:
        return WeightedTokens(tokens=list(self.tokens), weights=list(self.weights))


def check_messages(messages: Sequence[Message], *, roles: tuple[str, ...] = ROLES) -> None:
    """ValueError unless every message is {"role": one of `roles`, "content": str}."""
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {index} must be an object, got {type(message).__name__}")
        absent = [key for key in ("role", "content") if key not in message]
        if absent:
            raise ValueError(
                f"message {index} is missing {absent}; a message is "
                '{"role": ..., "content": "..."}'
            )
        role, content = message["role"], message["content"]
        if role not in roles:
            raise ValueError(f"message {index}: role {role!r} is not one of {list(roles)}")
        if not isinstance(content, str):
            raise ValueError(
                f"message {index}: content must be a string, got {type(content).__name__}"
            )


def trained_indices(messages: Sequence[Message], *, train_on: TrainOn) -> set[int]:
    """Indices of the assistant messages that get loss weight."""
    assistant = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if train_on == "all_assistant":
        return set(assistant)
    if train_on == "last_assistant":
        return set(assistant[-1:])
    raise ValueError(f"train_on must be 'all_assistant' or 'last_assistant', got {train_on!r}")


def special_token_id(tokenizer, token: str, *, renderer: str) -> int:
    """Id of a format's marker token, or a ValueError naming the tokenizer."""
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(
            f"renderer {renderer!r} needs the token {token!r}, which tokenizer "
            f"{tokenizer.name_or_path!r} does not have; 'role_colon' works with any tokenizer"
        )
    return token_id
