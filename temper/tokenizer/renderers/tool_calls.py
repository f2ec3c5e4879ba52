"""A small tool-call convention in plain text: what a call and its result look like as tokens.

    <prompt>?<argument><eos>=<result>\n<answer><eos>

An action whose text starts with `call_prefix` is a call of the environment's tool with the
rest of the text as its argument; the environment answers with `result_prefix`, the result
text and `result_suffix` as the next observation (or `error_text` in place of the result when
the call failed or timed out). Any other action is the final answer. The defaults use only
characters of the built-in "digits" vocabulary, so a tiny model can learn the format; an env
with several tools would name the tool in the argument. Parsing decodes the sampled tokens
(it reads them, never re-encodes them into the context); rendering encodes each piece on its
own, like the chat renderers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from temper.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class ToolCallFormat:
    call_prefix: str = "?"
    """An action starting with this text is a tool call."""
    result_prefix: str = "="
    """Starts the observation that answers a call."""
    result_suffix: str = "\n"
    """Ends it."""
    error_text: str = "?"
    """The result text of a call that failed or timed out."""

    def parse_call(self, tokenizer: Tokenizer, action_tokens: Sequence[int]) -> str | None:
        """The argument of a tool call, or None when the action is not one."""
        text = tokenizer.decode(list(action_tokens), skip_special_tokens=True)
        if not text.startswith(self.call_prefix):
            return None
        return text.removeprefix(self.call_prefix)

    def call_tokens(self, tokenizer: Tokenizer, argument: str) -> list[int]:
        """A call as the policy writes it, ending with EOS (demonstrations)."""
        return [*tokenizer.encode(self.call_prefix + argument), tokenizer.eos_token_id]

    def result_tokens(self, tokenizer: Tokenizer, result: str | None) -> list[int]:
        """The observation answering a call; `result=None` for a failed call."""
        text = self.error_text if result is None else result
        return tokenizer.encode(self.result_prefix + text + self.result_suffix)
