"""`qwen3` and `qwen3_no_think`: the Qwen3 chat format (ChatML with think blocks).

Every message is `<|im_start|>{role}\\n{content}<|im_end|>\\n`. Trained tokens are an
assistant message's body and its `<|im_end|>`; the header `<|im_start|>assistant\\n` and the
newline after `<|im_end|>` are not.

Think blocks, as Qwen3's own chat template writes them (without tools):
- An assistant message's content may hold its reasoning as `<think>...</think>` before the
  visible answer.
- Assistant messages before the last user message lose their reasoning: only the visible
  answer is rendered (history never carries old reasoning).
- An assistant message after the last user message is rendered as
  `<think>\\n{reasoning}\\n</think>\\n\\n{answer}` when it is the last message or has reasoning;
  a last reply without reasoning thus gets an empty block `<think>\\n\\n</think>\\n\\n`.

`qwen3` (thinking on): the generation prompt ends at `<|im_start|>assistant\\n` and the model
writes the think block itself, so the block (empty or not) is trained.
`qwen3_no_think` (`enable_thinking=False` in Qwen3's template): the generation prompt also
holds the empty block, so for training the empty block is prompt (weight 0) and only the answer
is trained; a reply after the last user message that carries reasoning is an error there.

Not handled: tools and tool calls, and a separate `reasoning_content` field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from temper.tokenizer.renderers.base import (
    Message,
    Segments,
    TrainOn,
    WeightedTokens,
    check_messages,
    special_token_id,
    trained_indices,
)
from temper.tokenizer.tokenizer import Tokenizer

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EMPTY_THINK_BLOCK = f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"


@dataclass(frozen=True)
class _AssistantBody:
    think_block: str
    """`<think>\\n...\\n</think>\\n\\n`, or "" where the template writes no block."""
    answer: str


class Qwen3Renderer:
    def __init__(self, tokenizer: Tokenizer, *, thinking: bool = True) -> None:
        self.tokenizer = tokenizer
        self.thinking = thinking
        self.name = "qwen3" if thinking else "qwen3_no_think"
        self.chat_template: str | None = None  # Qwen3's own, in its tokenizer directory
        self.im_start_id = special_token_id(tokenizer, IM_START, renderer=self.name)
        self.im_end_id = special_token_id(tokenizer, IM_END, renderer=self.name)

    def render(
        self, messages: Sequence[Message], *, train_on: TrainOn = "all_assistant"
    ) -> WeightedTokens:
        check_messages(messages)
        return self._render(messages, trained=trained_indices(messages, train_on=train_on))

    def generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        check_messages(messages)
        segments = Segments(self.tokenizer)
        segments.add_ids(self._render(messages, trained=set()).tokens, weight=0.0)
        self._add_header(segments, "assistant")
        if not self.thinking:
            segments.add_text(EMPTY_THINK_BLOCK, weight=0.0)
        return segments.result().tokens

    @property
    def stop(self) -> list[int]:
        return [self.im_end_id]

    def parse_response(self, tokens: Sequence[int]) -> str:
        ids = list(tokens)
        if self.im_end_id in ids:
            ids = ids[: ids.index(self.im_end_id)]
        return self.tokenizer.decode(ids)

    def _render(self, messages: Sequence[Message], *, trained: set[int]) -> WeightedTokens:
        users = [i for i, message in enumerate(messages) if message["role"] == "user"]
        last_query = users[-1] if users else len(messages) - 1
        segments = Segments(self.tokenizer)
        for index, message in enumerate(messages):
            self._add_header(segments, message["role"])
            if message["role"] != "assistant":
                segments.add_text(message["content"], weight=0.0)
                segments.add_ids([self.im_end_id], weight=0.0)
            else:
                is_last = index == len(messages) - 1
                body = _assistant_body(message["content"], current=index > last_query, last=is_last)
                self._add_assistant(segments, body, trained=index in trained, index=index)
            segments.add_text("\n", weight=0.0)
        return segments.result()

    def _add_header(self, segments: Segments, role: str) -> None:
        segments.add_ids([self.im_start_id], weight=0.0)
        segments.add_text(f"{role}\n", weight=0.0)

    def _add_assistant(
        self, segments: Segments, body: _AssistantBody, *, trained: bool, index: int
    ) -> None:
        weight = 1.0 if trained else 0.0
        if self.thinking:
            segments.add_text(body.think_block + body.answer, weight=weight)
        else:
            if body.think_block not in ("", EMPTY_THINK_BLOCK):
                raise ValueError(
                    f"message {index}: renderer 'qwen3_no_think' trains replies without "
                    "reasoning, but this reply has a <think> block; use renderer 'qwen3'"
                )
            segments.add_text(body.think_block, weight=0.0)
            segments.add_text(body.answer, weight=weight)
        segments.add_ids([self.im_end_id], weight=weight)


def _assistant_body(content: str, *, current: bool, last: bool) -> _AssistantBody:
    """Split `content` into reasoning and answer the way Qwen3's template does.

    `current`: the message comes after the last user message; `last`: it ends the conversation.
    """
    reasoning = ""
    if THINK_CLOSE in content:
        before, _, _ = content.partition(THINK_CLOSE)
        reasoning = before.rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
        content = content.split(THINK_CLOSE)[-1].lstrip("\n")
    if current and (last or reasoning):
        block = f"{THINK_OPEN}\n{reasoning.strip(chr(10))}\n{THINK_CLOSE}\n\n"
        return _AssistantBody(think_block=block, answer=content.lstrip("\n"))
    return _AssistantBody(think_block="", answer=content)
