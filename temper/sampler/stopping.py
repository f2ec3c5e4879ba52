"""Stop strings: find the first generated token after which the text contains a stop string.

Semantics (Tinker's): `push` returns True on the first token after which the decoded text of
all tokens pushed so far (special tokens decoded as their text) contains any stop string. That
token is the last one kept, so the tokens that complete a stop string end the completion.

The text is never re-decoded from the start. It is built incrementally the way TGI and vLLM
detokenize while streaming, with two offsets into the pushed tokens:

    tokens[:prefix_offset]              text already searched and dropped (but a tail)
    tokens[prefix_offset:read_offset]   context: decoded again so that decoders which treat
                                        the first token specially (SentencePiece strips its
                                        leading space) decode the next tokens as they would
                                        inside the whole sequence
    tokens[read_offset:]                pending: their text is decode(tokens[prefix_offset:])
                                        minus the text of the context

Pending text is committed (the offsets move up) only when it does not end in U+FFFD: a
byte-level BPE token may end inside a multi-byte UTF-8 character, which decodes to U+FFFD
until a later token brings its remaining bytes. The committed text then ends on a character
boundary, so decoding from there on is exact. Pending text is searched on every push all the
same, so a stop string followed by half a character in the same token is found at once.

Only the region where a new match can end is searched: the last (longest stop string - 1)
committed characters plus the pending text. A push therefore costs one decode of the context
and pending tokens (usually one or two tokens; longer only while a run of tokens keeps
ending in an incomplete or invalid character) plus a substring search over a short string.

The incremental text equals the full decode for decoders that decode a sequence as the
concatenation of its parts at character boundaries (byte-level BPE, SentencePiece, the
built-in word-level vocabularies). Two known departures, both outside what stop strings are
for: `tokenizers`' ByteFallback decoder turns a whole run of byte tokens into U+FFFD once the
run becomes invalid UTF-8, rewriting text already searched, so only a stop string that holds
U+FFFD can match differently; and decoders that rewrite text across token boundaries
(WordPiece's clean-up of spaces before punctuation) may differ near a boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

from temper.tokenizer.tokenizer import Tokenizer

_REPLACEMENT_CHARACTER = "\ufffd"
"""What decoders emit for bytes that are not (yet) a whole UTF-8 character."""


class StopStringMatcher:
    """Watch one sequence's generated tokens for stop strings; one `push` per token.

    Example: with stop strings ("\\n\\nUser:",), tokens decoding to "Hi", "\\n", "\\nUs",
    "er:" push as False, False, False, True.
    """

    stop_strings: tuple[str, ...]
    stopped: bool
    """True once a stop string has appeared; later pushes return True too."""
    matched: str | None
    """The stop string found (the first of `stop_strings` in the searched text), or None."""

    def __init__(self, stop_strings: Sequence[str], *, tokenizer: Tokenizer) -> None:
        if isinstance(stop_strings, str) or not all(isinstance(s, str) for s in stop_strings):
            raise TypeError(f"stop_strings must be a sequence of strings, got {stop_strings!r}")
        if not stop_strings or any(s == "" for s in stop_strings):
            raise ValueError(
                f"stop_strings must be one or more non-empty strings, got {list(stop_strings)!r}"
            )
        self.stop_strings = tuple(stop_strings)
        self.stopped = False
        self.matched = None
        self._tokenizer = tokenizer
        # A match that ends in new text can start at most this many characters before it.
        self._tail_length = max(len(s) for s in self.stop_strings) - 1
        self._tail = ""
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        # decode(tokens[prefix_offset:read_offset]), kept so that a push decodes once unless
        # it commits.
        self._context_text = ""

    def push(self, token_id: int) -> bool:
        """Add the next generated token; True if the text now contains a stop string."""
        if self.stopped:
            return True
        self._tokens.append(token_id)
        text = self._decode(self._tokens[self._prefix_offset :])
        pending = text[len(self._context_text) :]
        searched = self._tail + pending
        self.matched = next((s for s in self.stop_strings if s in searched), None)
        if self.matched is not None:
            self.stopped = True
            return True
        if pending and not pending.endswith(_REPLACEMENT_CHARACTER):
            self._tail = searched[max(0, len(searched) - self._tail_length) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            self._context_text = self._decode(self._tokens[self._prefix_offset :])
        return False

    def _decode(self, token_ids: Sequence[int]) -> str:
        # Special tokens stay in the text, so a stop string may name one ("<|im_end|>").
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)


def find_stop(
    token_ids: Sequence[int], stop_strings: Sequence[str], *, tokenizer: Tokenizer
) -> int | None:
    """Number of tokens to keep: 1 + the index of the token that completes a stop string.

    None when the text of `token_ids` contains none of `stop_strings`.
    """
    matcher = StopStringMatcher(stop_strings, tokenizer=tokenizer)
    for index, token_id in enumerate(token_ids):
        if matcher.push(token_id):
            return index + 1
    return None
