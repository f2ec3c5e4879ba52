"""Tokenizers: HF tokenizer directories loaded with `tokenizers`, and built-in toy vocabularies."""

from __future__ import annotations

from temper.tokenizer.builtin import build_builtin_tokenizer, builtin_names, save_builtin_tokenizer
from temper.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "Tokenizer",
    "build_builtin_tokenizer",
    "builtin_names",
    "load_tokenizer",
    "save_builtin_tokenizer",
]
