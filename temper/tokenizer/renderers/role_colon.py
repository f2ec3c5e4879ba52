"""`role_colon`: a plain-text chat format that any tokenizer can encode.

    System: Answer in one word.

    User: What color is the sky?

    Assistant: Blue.<eos>

    User: ...

Each message is `<Role>: <content>` followed by a blank line; an assistant message ends with
the tokenizer's EOS token before its blank line, so sampling stops there. Trained tokens are
" <content>" and the EOS (the space after the colon belongs to the reply, so the generation
prompt ends at "Assistant:" on a token boundary every tokenizer agrees on). Besides EOS, the
text "\\n\\nUser:" stops sampling, for a model that has not learned to end its replies yet.
"""

from __future__ import annotations

from collections.abc import Sequence

from temper.tokenizer.renderers.base import (
    Message,
    Segments,
    TrainOn,
    WeightedTokens,
    check_messages,
    trained_indices,
)
from temper.tokenizer.tokenizer import Tokenizer

ROLE_HEADERS = {"system": "System:", "user": "User:", "assistant": "Assistant:"}
SEPARATOR = "\n\n"

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- 'Assistant: ' + message['content'] + eos_token + '\\n\\n' }}"
    "{%- else %}"
    "{{- {'system': 'System:', 'user': 'User:'}[message['role']] + ' ' + message['content'] "
    "+ '\\n\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'Assistant:' }}{%- endif %}"
)
"""This format as a chat template (transformers' `apply_chat_template`), for a model directory
trained on it: its text tokenizes to what `render` and `generation_prompt` give."""


class RoleColonRenderer:
    name = "role_colon"
    chat_template: str | None = CHAT_TEMPLATE

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def render(
        self, messages: Sequence[Message], *, train_on: TrainOn = "all_assistant"
    ) -> WeightedTokens:
        check_messages(messages)
        trained = trained_indices(messages, train_on=train_on)
        segments = Segments(self.tokenizer)
        for index, message in enumerate(messages):
            self._add_message(segments, message, trained=index in trained)
        return segments.result()

    def generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        check_messages(messages)
        segments = Segments(self.tokenizer)
        for message in messages:
            self._add_message(segments, message, trained=False)
        segments.add_text(ROLE_HEADERS["assistant"], weight=0.0)
        return segments.result().tokens

    @property
    def stop(self) -> list[str]:
        # EOS stops too: SamplingParams keeps EOS as a stop whenever stop strings are given.
        return [SEPARATOR + ROLE_HEADERS["user"]]

    def parse_response(self, tokens: Sequence[int]) -> str:
        eos = self.tokenizer.eos_token_id
        ids = list(tokens)
        if eos in ids:
            ids = ids[: ids.index(eos)]
        text = self.tokenizer.decode(ids)
        return text.split(SEPARATOR + ROLE_HEADERS["user"])[0].removeprefix(" ")

    def _add_message(self, segments: Segments, message: Message, *, trained: bool) -> None:
        role, content = message["role"], message["content"]
        if role != "assistant":
            segments.add_text(f"{ROLE_HEADERS[role]} {content}{SEPARATOR}", weight=0.0)
            return
        weight = 1.0 if trained else 0.0
        segments.add_text(ROLE_HEADERS["assistant"], weight=0.0)
        segments.add_text(f" {content}", weight=weight)
        segments.add_ids([self.tokenizer.eos_token_id], weight=weight)
        segments.add_text(SEPARATOR, weight=0.0)
