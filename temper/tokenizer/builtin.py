"""Small built-in vocabularies for toy tasks, saved as real HF tokenizer directories.

Each vocabulary is a `tokenizers` model whose Split pre-tokenizer cuts text into vocabulary
pieces and whose Fuse decoder joins them back with nothing in between, so
`decode(encode(text)) == text` exactly (spaces and newlines included) for text the vocabulary
covers. The ids start with the ChatML special tokens, the same in each vocabulary:

    0 <|endoftext|> (pad)   1 <|im_start|>   2 <|im_end|> (eos)   3 <unk> ("words" only)

- "digits": digits, arithmetic symbols, space and newline, plus the ChatML role names as whole
  tokens so that the chat template renders; other text cannot be encoded (no <unk>).
- "letters": one token per printable ASCII character and newline; no <unk>.
- "words": a few hundred simple English words (lower case and capitalized), one token per other
  printable ASCII character; a letter run that is not a word, and any other character, is <unk>.
- "bytes": one token per UTF-8 byte (byte-level, as GPT-2 and Qwen write bytes, with no
  merges): any text encodes, at a token per byte. For trying chat data, or a tinker-cookbook
  recipe, on a tiny random model.

"bytes" is a BPE model without merges over the 256 byte characters. "words" is a WordLevel
model with its <unk>. "digits" and "letters" have no <unk>, and a
WordLevel model must name one, so they are Unigram models over single characters (every piece
scored alike, so each character is its own token) with the role names as added tokens: they
declare no unknown token, and text they cannot cover fails to encode (Tokenizer names the
pieces).

`tokenizer_config.json` names the special tokens and carries a Qwen3-style ChatML template, so
`transformers.AutoTokenizer.from_pretrained(dir)` loads a saved directory with the same ids.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from temper.tokenizer.tokenizer import Tokenizer

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<unk>"
CHATML_SPECIAL_TOKENS = (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)
ROLE_NAMES = ("system", "user", "assistant")

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML as Qwen3 writes it (without the thinking blocks): one block per message, then an
open assistant block when `add_generation_prompt` is true."""

# Letters a-z and A-Z are not here: in "words" a letter run is one piece.
_NON_LETTER_CHARACTERS = string.digits + string.punctuation + " \n"
_PRINTABLE_CHARACTERS = string.ascii_letters + _NON_LETTER_CHARACTERS

_WORDS = """
a about add after again all also always am an and animal answer any are as ask assistant at away
back bad be because bed been before begin best better big bird black blue boat body book both
box boy bread bring brother brown but buy by call came can car cat change child children city
clean close cold color come could count cow cup cut day did different do does dog done door down
draw drink each earth eat egg eight eighteen eleven end even every eye face fall far fast father
feel few fifteen find fine fire first fish five fly food foot for forty four fourteen friend
from full game gave get girl give go good got great green grow had half hand happy hard has hat
have he head hear help her here high him his hold home horse hot house how hundred i if in into
is it its jump just keep kind know large last late learn left less let letter light like line
list little live long look lot love low made make man many may me mean minus more morning most
mother move much must my name near need never new next night nine nineteen no not now number of
off old on once one only open or other our out over own page paper part people pick place plant
play plus point put question quick rain read red right river road room run said same saw say
school sea second see seven seventeen she short should show side sing sister sit six sixteen
sixty sleep slow small so some song soon sound start stop story sum sun system table take talk
tell ten than that the their them then there these they thing think third thirteen thirty this
those three time times to today together too took tree true try turn twelve twenty two under up
us use user very walk want warm was water way we well went were what when where which white who
why will wind with word work world would write wrong year yellow yes yet you young your zero
"""


def builtin_names() -> tuple[str, ...]:
    """Names accepted by `build_builtin_tokenizer`."""
    return tuple(_BUILDERS)


def build_builtin_tokenizer(name: str) -> Tokenizer:
    """The built-in vocabulary `name` ("digits", "letters", "words" or "bytes") as a Tokenizer."""
    if name not in _BUILDERS:
        raise ValueError(
            f"unknown built-in tokenizer name {name!r}; valid names are {list(builtin_names())}"
        )
    backend, config = _BUILDERS[name]()
    return Tokenizer(backend, config=config, name_or_path=f"builtin:{name}")


def save_builtin_tokenizer(name: str, *, out_dir: str | Path) -> Tokenizer:
    """Build the built-in vocabulary `name`, save it to `out_dir` and return it."""
    tokenizer = build_builtin_tokenizer(name)
    tokenizer.save(out_dir)
    return tokenizer


def _digits() -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    characters = list(string.digits + "+-*/=()?:,. \n")
    # Role names first: the regex takes the first alternative that matches, so "user" stays whole.
    pattern = "|".join([*ROLE_NAMES, r"[\s\S]"])
    return _word_level([*ROLE_NAMES, *characters], split_pattern=pattern, unk_token=None)


def _letters() -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    return _word_level(list(_PRINTABLE_CHARACTERS), split_pattern=r"[\s\S]", unk_token=None)


def _words() -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    words = _WORDS.split()
    pieces = [*_NON_LETTER_CHARACTERS, *words, *(word.capitalize() for word in words)]
    return _word_level(pieces, split_pattern="[A-Za-z]+|[^A-Za-z]", unk_token=UNK_TOKEN)


def _bytes() -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    entries = [*CHATML_SPECIAL_TOKENS, *byte_characters()]
    vocab = {piece: token_id for token_id, piece in enumerate(entries)}
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [tokenizers.AddedToken(token, special=True, normalized=False) for token in entries[:3]]
    )
    return backend, _tokenizer_config(unk_token=None)


def byte_characters() -> list[str]:
    """The character byte-level tokenizers write for each byte value 0-255: printable Latin-1
    bytes as themselves, the others as the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(0x100, 0x200))
    return [chr(byte) if byte in printable else chr(next(shifted)) for byte in range(256)]


def _word_level(
    pieces: list[str], *, split_pattern: str, unk_token: str | None
) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """A tokenizer over the special tokens then `pieces`, and its tokenizer config: WordLevel
    with `unk_token`, else Unigram with no unknown token (see the module docstring)."""
    special_tokens = [*CHATML_SPECIAL_TOKENS, *([unk_token] if unk_token else [])]
    entries = [*special_tokens, *pieces]
    vocab = {piece: token_id for token_id, piece in enumerate(entries)}
    assert len(vocab) == len(entries), "duplicate vocabulary pieces"
    if unk_token is not None:
        backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=unk_token))
    else:
        backend = tokenizers.Tokenizer(models.Unigram([(entry, 0.0) for entry in entries]))
        # Unigram needs each character of a piece in the vocabulary; whole-word pieces (the
        # role names of "digits") are matched as added tokens before the model sees the text.
        words = [piece for piece in pieces if len(piece) > 1]
        backend.add_tokens([tokenizers.AddedToken(w, normalized=False) for w in words])
    backend.pre_tokenizer = pre_tokenizers.Split(
        tokenizers.Regex(split_pattern), behavior="isolated"
    )
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [tokenizers.AddedToken(token, special=True, normalized=False) for token in special_tokens]
    )
    return backend, _tokenizer_config(unk_token=unk_token)


def _tokenizer_config(*, unk_token: str | None) -> dict[str, Any]:
    """tokenizer_config.json of a built-in vocabulary."""
    return {
        # PreTrainedTokenizerFast wraps tokenizer.json as is, in transformers 4 and 5 alike.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": unk_token,
        # transformers would otherwise strip the space before punctuation when decoding.
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }


_BUILDERS: MappingProxyType[str, Callable[[], tuple[tokenizers.Tokenizer, dict[str, Any]]]] = (
    MappingProxyType({"digits": _digits, "letters": _letters, "words": _words, "bytes": _bytes})
)
