"""A thin wrapper over the HF `tokenizers` library that loads a local HF tokenizer directory.

A tokenizer directory is what HF model directories hold: `tokenizer.json` (the whole Rust
tokenizer: model, pre-tokenizer, decoder, added tokens) and `tokenizer_config.json` (the special
token names, the chat template and transformers' settings). The chat template may instead sit in
`chat_template.jinja`, which is where transformers 5 writes it.

Unusual choices:
- `transformers` is not imported: the directory is read with `tokenizers` and `json` alone, and
  what we save loads with `transformers.AutoTokenizer.from_pretrained(dir)` too.
- EOS is `eos_token` of `tokenizer_config.json` (Qwen3 instruct: `<|im_end|>`), never the model's
  `generation_config.json`; a directory without one is an error, since sampling needs it.
- Nothing is rendered here: the chat template is exposed as a string for the renderers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class Tokenizer:
    """Encode and decode text with a `tokenizers.Tokenizer` and its HF `tokenizer_config.json`.

    Build it with `Tokenizer.from_dir(path)` (or `load_tokenizer(path)`); `config` is the parsed
    `tokenizer_config.json`, kept as given so that `save()` writes it back.
    """

    name_or_path: str
    """The directory it was loaded from, or "builtin:<name>"."""
    vocab_size: int
    """Number of token ids, added tokens included; valid ids are 0 .. vocab_size - 1."""
    eos_token_id: int
    """The token that ends a completion (`eos_token` of tokenizer_config.json)."""
    pad_token_id: int | None
    bos_token_id: int | None
    unk_token_id: int | None
    chat_template: str | None
    """The Jinja chat template as a string (rendering is the renderers' job), or None."""

    def __init__(
        self, backend: tokenizers.Tokenizer, *, config: Mapping[str, Any], name_or_path: str
    ) -> None:
        self._backend = backend
        self._config = dict(config)
        self.name_or_path = name_or_path
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        # A plain dict, not a MappingProxyType, so that the tokenizer pickles (spawned ranks).
        self._special_tokens = {
            added.content: token_id
            for token_id, added in sorted(backend.get_added_tokens_decoder().items())
            if added.special
        }
        eos_token_id = self._special_token_id("eos_token")
        if eos_token_id is None:
            raise ValueError(
                f"{CONFIG_FILE} of tokenizer {name_or_path!r} has no eos_token; set it to the "
                f"token that ends a completion, one of {list(self.special_tokens)}"
            )
        self.eos_token_id = eos_token_id
        self.pad_token_id = self._special_token_id("pad_token")
        self.bos_token_id = self._special_token_id("bos_token")
        self.unk_token_id = self._special_token_id("unk_token")
        self.chat_template = _chat_template(self._config, name_or_path=name_or_path)

    @property
    def special_tokens(self) -> Mapping[str, int]:
        """Content -> id of every special token (those marked special in tokenizer.json)."""
        return MappingProxyType(self._special_tokens)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and `tokenizer_config.json` (and `chat_template.jinja`)."""
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(
                f"tokenizer directory {str(directory)!r} does not exist or is not a directory; "
                f"it must hold {TOKENIZER_FILE} and {CONFIG_FILE}"
            )
        missing = [
            name for name in (TOKENIZER_FILE, CONFIG_FILE) if not (directory / name).is_file()
        ]
        if missing:
            raise FileNotFoundError(
                f"tokenizer directory {str(directory)!r} is missing {missing}; "
                f"a tokenizer directory holds {TOKENIZER_FILE} and {CONFIG_FILE}"
            )
        backend = tokenizers.Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
        template_file = directory / CHAT_TEMPLATE_FILE
        if config.get("chat_template") is None and template_file.is_file():
            config["chat_template"] = template_file.read_text(encoding="utf-8")
        return cls(backend, config=config, name_or_path=str(directory))

    def save(self, path: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (chat template inside) to `path`."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / TOKENIZER_FILE))
        (directory / CONFIG_FILE).write_text(_config_text(self._config), encoding="utf-8")

    @staticmethod
    def replace_chat_template(path: str | Path, template: str) -> None:
        """Make `template` the chat template of the tokenizer directory `path`: in its
        tokenizer config, with any `chat_template.jinja` (which would win) removed. Files are
        replaced, never written through, so a directory hard-linked to a checkpoint's (an
        export) leaves the checkpoint's files as they were."""
        directory = Path(path)
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
        config["chat_template"] = template
        staged = directory / f".{CONFIG_FILE}.new"
        staged.write_text(_config_text(config), encoding="utf-8")
        os.replace(staged, directory / CONFIG_FILE)
        (directory / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids.

        `add_special_tokens` runs the tokenizer's post-processor (e.g. a BOS some models add).
        """
        try:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as error:
            if type(error) is not Exception:  # e.g. TypeError for a non-str: not the vocabulary
                raise
            raise self._encode_error([text], error) from error

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = False
    ) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by the Rust library."""
        try:
            encodings = self._backend.encode_batch(
                list(texts), add_special_tokens=add_special_tokens
            )
        except Exception as error:
            if type(error) is not Exception:  # e.g. TypeError for a non-str: not the vocabulary
                raise
            raise self._encode_error(texts, error) from error
        return [encoding.ids for encoding in encodings]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `token_ids`; raises ValueError for ids outside 0 .. vocab_size - 1."""
        ids = list(token_ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(
                f"token id {bad} is outside the vocabulary of tokenizer {self.name_or_path!r}; "
                f"valid ids are 0 to {self.vocab_size - 1}"
            )
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of the vocabulary entry `token`, or None when there is none."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary entry of `token_id` (raw, e.g. with byte-level symbols)."""
        token = self._backend.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
        if token is None:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary of tokenizer "
                f"{self.name_or_path!r}; valid ids are 0 to {self.vocab_size - 1}"
            )
        return token

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
            f"eos_token_id={self.eos_token_id})"
        )

    def _special_token_id(self, key: str) -> int | None:
        """Id of the token that `tokenizer_config.json` names under `key`, None if unset."""
        value = self._config.get(key)
        # transformers writes either the content or an AddedToken dict with a "content" field.
        token = value.get("content") if isinstance(value, dict) else value
        if token is None:
            return None
        if not isinstance(token, str):
            raise ValueError(
                f"{CONFIG_FILE} of tokenizer {self.name_or_path!r} has {key}={value!r}; "
                "expected a token string, a dict with 'content', or null"
            )
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"{CONFIG_FILE} of tokenizer {self.name_or_path!r} has {key}={token!r}, which "
                f"is not in its vocabulary; special tokens are {list(self.special_tokens)}"
            )
        return token_id

    def _encode_error(self, texts: Sequence[str], error: Exception) -> ValueError:
        """A ValueError naming the pieces of `texts` that a vocabulary without <unk> lacks."""
        unknown = sorted({piece for text in texts for piece in self.unknown_pieces(text)})
        detail = f"pieces not in the vocabulary: {unknown[:20]}" if unknown else str(error)
        return ValueError(f"tokenizer {self.name_or_path!r} cannot encode the text; {detail}")

    def unknown_pieces(self, text: str) -> list[str]:
        """The pieces of `text` (after pre-tokenization) that are not in the vocabulary: what a
        vocabulary without <unk> cannot encode, and what one with it encodes as <unk>."""
        pre_tokenizer = self._backend.pre_tokenizer
        if pre_tokenizer is None:
            return []
        # Special-token strings are matched before pre-tokenization, so take them out first.
        pattern = "|".join(re.escape(token) for token in self.special_tokens) or "(?!)"
        return [
            piece
            for segment in re.split(pattern, text)
            for piece, _ in pre_tokenizer.pre_tokenize_str(segment)
            if self._backend.token_to_id(piece) is None
        ]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load the HF tokenizer directory at `path` (see `Tokenizer.from_dir`)."""
    return Tokenizer.from_dir(path)


def _config_text(config: Mapping[str, Any]) -> str:
    """`tokenizer_config.json` as this module writes it."""
    return json.dumps(config, indent=2, ensure_ascii=False) + "\n"


def _chat_template(config: Mapping[str, Any], *, name_or_path: str) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):
        # Older transformers wrote several named templates; "default" is the one they apply.
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(
            f"{CONFIG_FILE} of tokenizer {name_or_path!r} has chat_template of type "
            f"{type(template).__name__}; expected a Jinja string or a list of named templates"
        )
    return template
