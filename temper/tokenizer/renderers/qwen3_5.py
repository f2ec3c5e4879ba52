"""`qwen3_5`: Qwen3.5's chat format (ChatML, think blocks, XML tool calls), as tinker-cookbook
writes it, token for token (tests/tokenizer/renderers/test_qwen3_5.py checks it against
the cookbook's `qwen3_5` renderer). Qwen3.6 has the same format.

Every message is `<|im_start|>{role}\\n{content}<|im_end|>`, the messages joined by "\\n";
content is trimmed of surrounding whitespace. How it differs from Qwen3 (`qwen3.py`):

- The generation prompt ends `<|im_start|>assistant\\n<think>\\n`: the reply's think block is
  already open. The sampled reply writes the reasoning, `\\n</think>\\n\\n`, the answer and
  `<|im_end|>`; `parse_*` put the prefilled `<think>\\n` back before reading it.
- An assistant message after the last user message is written
  `<think>\\n{reasoning}\\n</think>\\n\\n{answer}`, or with the empty block
  `<think>\\n\\n</think>\\n\\n` when it has no reasoning; before the last user message, with
  no block. Reasoning is kept only in the last message: the reasoning of every earlier
  assistant message is dropped (`qwen3_5_preserve_thinking` keeps it in every message).
- Tool results (role `tool`) are written in a user message as
  `<tool_response>\\n{content}\\n</tool_response>`; a run of consecutive tool results shares
  one user message, the results separated by "\\n". An assistant message's `tool_calls`
  follow its answer (after a blank line when there is one) in the XML form of
  `qwen3_5_tools.py`.

An assistant message's content carries its reasoning inline, `<think>...</think>` before the
answer (more than one block may interleave with text). Trained: an assistant message's body
and `<|im_end|>`; its header, and for the last message the `<think>\\n` the generation prompt
already holds, are not. In the empty block of the last message, `\\n</think>\\n\\n` is
trained (the model writes it); in the blocks of earlier messages, nothing of the block is.

`qwen3_5_disable_thinking` (`enable_thinking=False`): the generation prompt ends with the
whole empty block, so a last message with reasoning cannot be trained (an error).

Each piece is encoded on its own as the cookbook encodes it: a message's header, then its
body. Where they differ from tinker-cookbook: with `train_on="all_assistant"` the cookbook
trains the prefilled `<think>\\n` of a last reply that has reasoning (and does not refuse a
last reply with reasoning under `qwen3_5_disable_thinking`); here every mode treats the last
reply as `last_assistant` does. A tool message's `name`/`tool_call_id` are not written (the
format has no place for them). Images are not handled.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from temper.tokenizer.renderers.base import (
    ROLES,
    Message,
    Segments,
    TrainOn,
    WeightedTokens,
    check_messages,
    special_token_id,
    trained_indices,
)
from temper.tokenizer.renderers.qwen3 import IM_END, IM_START, THINK_CLOSE, THINK_OPEN
from temper.tokenizer.renderers.qwen3_5_tools import (
    MAX_UNPARSED_CHARS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    UNTERMINATED,
    ToolCall,
    UnparsedToolCall,
    format_tool_call,
    parse_tool_calls,
    tool_calls_of,
    tools_system_prompt,
)
from temper.tokenizer.tokenizer import Tokenizer

Qwen3_5Name = Literal["qwen3_5", "qwen3_5_disable_thinking", "qwen3_5_preserve_thinking"]
QWEN3_5_NAMES: tuple[str, ...] = get_args(Qwen3_5Name)
QWEN3_5_ROLES: tuple[str, ...] = (*ROLES, "tool")

EMPTY_THINK_BLOCK = f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_THINK_OR_CALL = re.compile(r"<think>(.*?)</think>|<tool_call>.*?</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class _Part:
    thinking: bool
    text: str


@dataclass(frozen=True)
class _Pieces:
    """One message as the cookbook encodes it: three strings, each encoded on its own."""

    header: str
    """Untrained: `<|im_start|>{role}\\n` (and what the generation prompt adds after it)."""
    lead: str
    """The header's rest past the generation prompt (last message only), trained with body."""
    body: str


@dataclass(frozen=True)
class ParsedReply:
    message: dict[str, Any]
    """{"role": "assistant", "content": ..., "tool_calls": [...]} ("tool_calls" only when
    the reply made calls); content holds the reasoning inline as `<think>...</think>`."""
    unparsed_tool_calls: tuple[UnparsedToolCall, ...]
    """Call blocks that did not parse, or an unterminated one; they are not in content."""
    complete: bool
    """The reply ended with `<|im_end|>`; False (cut off): content is its raw text."""


class Qwen3_5Renderer:
    def __init__(self, tokenizer: Tokenizer, *, name: Qwen3_5Name = "qwen3_5") -> None:
        if name not in QWEN3_5_NAMES:
            raise ValueError(f"unknown Qwen3.5 renderer {name!r}; valid: {list(QWEN3_5_NAMES)}")
        self.tokenizer = tokenizer
        self.name = name
        self.chat_template: str | None = None  # Qwen3.5's own, in its tokenizer directory
        self.thinking = name != "qwen3_5_disable_thinking"
        self.keeps_history_thinking = name == "qwen3_5_preserve_thinking"
        self.prefill = THINK_OPEN + "\n" if self.thinking else EMPTY_THINK_BLOCK
        """What the generation prompt writes after `<|im_start|>assistant\\n`."""
        self.im_start_id = special_token_id(tokenizer, IM_START, renderer=name)
        self.im_end_id = special_token_id(tokenizer, IM_END, renderer=name)

    def render(
        self, messages: Sequence[Message], *, train_on: TrainOn = "all_assistant"
    ) -> WeightedTokens:
        check_messages(messages, roles=QWEN3_5_ROLES)
        trained = trained_indices(messages, train_on=train_on)
        rendered = self._render(messages, trained=trained).result()
        final = len(messages) - 1
        if final not in trained or messages[final]["role"] != "assistant":
            return rendered
        # The generation prompt of the history ends inside the last reply (its prefill):
        # those tokens are prompt, never trained.
        history = self._render(messages[:final], trained=set())
        prompt = [*history.tokens, *self.tokenizer.encode(self._assistant_prefix(final))]
        if rendered.tokens[: len(prompt)] != prompt:
            if not self.thinking:
                raise ValueError(
                    f"message {final}: renderer {self.name!r} trains replies without "
                    "reasoning, but this reply has a <think> block; use renderer 'qwen3_5'"
                )
            return rendered
        weights = list(rendered.weights)
        weights[len(history.tokens) : len(prompt)] = [0.0] * (len(prompt) - len(history.tokens))
        return WeightedTokens(tokens=rendered.tokens, weights=weights)

    def generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        check_messages(messages, roles=QWEN3_5_ROLES)
        return self._render(messages, trained=set(), prompt=True).tokens

    @property
    def stop(self) -> list[int]:
        return [self.im_end_id]

    def parse_response(self, tokens: Sequence[int]) -> str:
        """The reply's content: its reasoning inline as `<think>...</think>`, then the
        answer; tool calls are left out (`parse_message` returns them)."""
        return self.parse_message(tokens).message["content"]

    def parse_message(self, tokens: Sequence[int]) -> ParsedReply:
        """The sampled reply `tokens` (after the generation prompt) as an assistant message."""
        ids = self._restore_prefill(list(tokens))
        num_ends = ids.count(self.im_end_id)
        if num_ends == 0:
            message = {"role": "assistant", "content": self.tokenizer.decode(ids)}
            return ParsedReply(message=message, unparsed_tool_calls=(), complete=False)
        if num_ends > 1:
            raise ValueError(
                f"the reply holds {num_ends} {IM_END} tokens; sample with stop={self.stop} "
                "so that it ends at the first"
            )
        text = self.tokenizer.decode(ids[: ids.index(self.im_end_id)])
        calls: list[ToolCall] = []
        unparsed: list[UnparsedToolCall] = []
        content = text
        if THINK_OPEN in text or TOOL_CALL_OPEN in text:
            parts, blocks = _content_parts(text, pattern=_THINK_OR_CALL)
            content = "".join(f"<think>{p.text}</think>" if p.thinking else p.text for p in parts)
            calls, unparsed = parse_tool_calls(blocks)
        if text.count(TOOL_CALL_OPEN) > text.count(TOOL_CALL_CLOSE):
            dangling = text[text.rfind(TOOL_CALL_OPEN) :][:MAX_UNPARSED_CHARS]
            unparsed.append(UnparsedToolCall(text=dangling, error=UNTERMINATED))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_message() for call in calls]
        return ParsedReply(message=message, unparsed_tool_calls=tuple(unparsed), complete=True)

    def tools_system_message(
        self, tools: Sequence[Mapping[str, Any]], *, system_prompt: str = ""
    ) -> dict[str, str]:
        """The system message that offers `tools` (JSON specifications: name, description,
        parameters) to the model, then `system_prompt`."""
        return {
            "role": "system",
            "content": tools_system_prompt(tools, system_prompt=system_prompt),
        }

    def _render(
        self, messages: Sequence[Message], *, trained: set[int], prompt: bool = False
    ) -> Segments:
        """The messages' tokens and weights; `prompt`: followed by the generation prompt."""
        users = [i for i, message in enumerate(messages) if message["role"] == "user"]
        last_user = users[-1] if users else -1
        segments = Segments(self.tokenizer)
        for index in range(len(messages)):
            pieces = self._pieces(messages, index, last_user=last_user)
            weight = 1.0 if index in trained else 0.0
            segments.add_text(pieces.header, weight=0.0)
            segments.add_text(pieces.lead, weight=weight)
            segments.add_text(pieces.body, weight=weight)
        if prompt:
            segments.add_text(self._assistant_prefix(len(messages)), weight=0.0)
        return segments

    def _assistant_prefix(self, index: int) -> str:
        """What the generation prompt of message `index` ends with."""
        return f"{_separator(index)}{IM_START}assistant\n{self.prefill}"

    def _pieces(self, messages: Sequence[Message], index: int, *, last_user: int) -> _Pieces:
        message = messages[index]
        role, is_last = message["role"], index == len(messages) - 1
        follows_tool = index > 0 and messages[index - 1]["role"] == "tool"
        precedes_tool = not is_last and messages[index + 1]["role"] == "tool"
        calls = tool_calls_of(message, index=index)
        if role == "assistant":
            parts = _trim(_content_parts(message["content"], pattern=_THINK)[0])
        else:
            parts = [_Part(thinking=False, text=message["content"].strip())]
        has_thinking = any(part.thinking for part in parts)
        if role == "tool" and follows_tool:
            header = "\n"  # the run of results shares the open user message
        else:
            header = f"{_separator(index)}{IM_START}{'user' if role == 'tool' else role}\n"
            if role == "assistant" and index > last_user and not has_thinking:
                header += EMPTY_THINK_BLOCK
        drops_thinking = role == "assistant" and not is_last and not self.keeps_history_thinking
        body = "".join(
            f"{THINK_OPEN}\n{part.text}\n{THINK_CLOSE}\n\n" if part.thinking else part.text
            for part in parts
            if not (part.thinking and drops_thinking)
        )
        if role == "tool":
            body = f"<tool_response>\n{body}\n</tool_response>"
        if calls:
            has_text = any(part.text.strip() for part in parts if not part.thinking)
            body += ("\n\n" if has_text else "") + "\n".join(map(format_tool_call, calls))
        if not (role == "tool" and precedes_tool):
            body += IM_END
        lead = ""
        prefix = self._assistant_prefix(index)
        if role == "assistant" and is_last and header.startswith(prefix):
            header, lead = prefix, header[len(prefix) :]
        return _Pieces(header=header, lead=lead, body=body)

    def _restore_prefill(self, ids: list[int]) -> list[int]:
        """`ids` with the generation prompt's `<think>\\n` put back in front when the reply
        closes a think block it did not open."""
        opening = self.tokenizer.encode(THINK_OPEN + "\n")
        closing = self.tokenizer.encode(THINK_CLOSE)
        if ids[: len(opening)] == opening:
            return ids
        if len(closing) == 1:
            closes = closing[0] in ids
        else:
            closes = THINK_CLOSE in self.tokenizer.decode(ids)
        return opening + ids if closes else ids


def _separator(index: int) -> str:
    return "\n" if index > 0 else ""


def _content_parts(text: str, *, pattern: re.Pattern[str]) -> tuple[list[_Part], list[str]]:
    """`text` split into reasoning and text parts, and the tool-call blocks `pattern` finds.

    A block's reasoning is stripped of surrounding whitespace (an empty block gives no part);
    the text right after a block loses its leading newlines (the block's framing).
    """
    parts: list[_Part] = []
    blocks: list[str] = []
    position, after_block = 0, False
    for match in pattern.finditer(text):
        before = text[position : match.start()]
        if before:
            parts.append(_Part(thinking=False, text=before.lstrip("\n") if after_block else before))
            after_block = False
        reasoning = match.group(1)
        if reasoning is None:
            blocks.append(match.group(0))
        elif reasoning:
            after_block = True
            if reasoning.strip("\n"):
                parts.append(_Part(thinking=True, text=reasoning.strip()))
        position = match.end()
    rest = text[position:]
    if rest:
        parts.append(_Part(thinking=False, text=rest.lstrip("\n") if after_block else rest))
    return parts, blocks


def _trim(parts: list[_Part]) -> list[_Part]:
    """The text parts trimmed as one text: leading whitespace off the first that has text
    left, trailing off the last (reasoning parts are left as they are)."""
    trimmed = list(parts)
    texts = [i for i, part in enumerate(parts) if not part.thinking]
    for indices, strip in ((texts, str.lstrip), (texts[::-1], str.rstrip)):
        for i in indices:
            trimmed[i] = _Part(thinking=False, text=strip(trimmed[i].text))
            if trimmed[i].text:
                break
    return trimmed
