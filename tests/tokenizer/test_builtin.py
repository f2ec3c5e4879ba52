"""Built-in vocabularies: exact round trips, and saved directories that transformers loads."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from temper.tokenizer import Tokenizer, build_builtin_tokenizer, builtin_names, load_tokenizer
from temper.tokenizer.builtin import save_builtin_tokenizer

PRINTABLE = string.ascii_letters + string.digits + string.punctuation + " \n"
SAMPLE_TEXTS = {
    "digits": ["12+30=42", "7 * 6 = 42\n", "(1-2)/3?: 4,5.", "user\n9\nassistant\n"],
    "letters": ["Hello, World!\n", "  a  b\n\nc ", "x = {'k': [1, 2]} # ~`^|\\"],
    "words": ["The cat can see the dog.", "What is 12 plus 30?\n42", "zebra Zebra, a!"],
    "bytes": ["Gr\u00fc\u00dfe, \u4e16\u754c!\n", "\ttabs\r\n and  spaces ", "emoji \U0001f600."],
}
MESSAGES = [
    {"role": "system", "content": "1,2"},
    {"role": "user", "content": "1+2"},
    {"role": "assistant", "content": "3"},
]
CHATML = "<|im_start|>system\n1,2<|im_end|>\n<|im_start|>user\n1+2<|im_end|>\n"


@pytest.fixture(scope="module")
def saved_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("builtin")
    for name in builtin_names():
        save_builtin_tokenizer(name, out_dir=root / name)
    return {name: root / name for name in builtin_names()}


@pytest.fixture(scope="module")
def auto_tokenizers(saved_dirs: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    return {
        name: AutoTokenizer.from_pretrained(directory, local_files_only=True)
        for name, directory in saved_dirs.items()
    }


def test_names_and_unknown_name() -> None:
    assert builtin_names() == ("digits", "letters", "words", "bytes")
    with pytest.raises(ValueError, match=r"'utf8'.*\['digits', 'letters', 'words', 'bytes'\]"):
        build_builtin_tokenizer("utf8")


@pytest.mark.parametrize("name", ["digits", "letters", "words", "bytes"])
def test_special_tokens_come_first(name: str) -> None:
    tokenizer = build_builtin_tokenizer(name)
    expected = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    if name == "words":
        expected["<unk>"] = 3
    assert dict(tokenizer.special_tokens) == expected
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 2, None)
    assert tokenizer.unk_token_id == (3 if name == "words" else None)
    assert "<|im_start|>" in tokenizer.chat_template


def test_vocabulary_sizes_stay_small() -> None:
    sizes = {name: build_builtin_tokenizer(name).vocab_size for name in builtin_names()}
    assert sizes["digits"] < 40
    assert sizes["letters"] == 3 + len(PRINTABLE)
    assert 500 < sizes["words"] < 1000
    assert sizes["bytes"] == 3 + 256


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_bytes_round_trip_any_text_one_token_per_byte(text: str) -> None:
    tokenizer = build_builtin_tokenizer("bytes")
    # A special token's text encodes as that token (below); Hypothesis draws such strings too,
    # from the constants in the code under test.
    assume(not any(special in text for special in tokenizer.special_tokens))
    ids = tokenizer.encode(text)
    assert ids == [3 + byte for byte in text.encode()]
    assert tokenizer.decode(ids) == text


def test_bytes_special_token_text_is_its_token() -> None:
    tokenizer = build_builtin_tokenizer("bytes")
    assert tokenizer.encode("a<|im_start|>") == [3 + ord("a"), 1]


def test_byte_characters_are_the_byte_level_alphabet() -> None:
    from tokenizers import pre_tokenizers

    from temper.tokenizer.builtin import byte_characters

    assert sorted(byte_characters()) == sorted(pre_tokenizers.ByteLevel.alphabet())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([*"0123456789+-*/=()?:,. \n", "user", "<|im_end|>"])))
def test_digits_round_trip(pieces: list[str]) -> None:
    tokenizer = build_builtin_tokenizer("digits")
    text = "".join(pieces)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert 0 not in ids  # nothing maps to pad


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=PRINTABLE))
def test_letters_round_trip_one_token_per_character(text: str) -> None:
    tokenizer = build_builtin_tokenizer("letters")
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    if "<|" not in text:  # hypothesis finds "<|im_start|>", which is one special token
        assert len(ids) == len(text)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["the", "The", "cat", "I", "a", "assistant", "zero", "sixty"]),
            st.text(alphabet=string.digits + string.punctuation + " \n", min_size=1, max_size=3),
        )
    )
)
def test_words_round_trip(pairs: list[tuple[str, str]]) -> None:
    tokenizer = build_builtin_tokenizer("words")
    text = "".join(word + separator for word, separator in pairs)
    ids = tokenizer.encode(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_words_unknown_word_is_unk() -> None:
    tokenizer = build_builtin_tokenizer("words")
    ids = tokenizer.encode("the zebra\t")
    assert ids == [tokenizer.token_to_id("the"), tokenizer.token_to_id(" "), 3, 3]
    assert tokenizer.unknown_pieces("the zebra\t") == ["zebra", "\t"]


@pytest.mark.parametrize(("name", "text"), [("digits", "1 + x"), ("letters", "caf\u00e9")])
def test_characters_outside_alphabet_are_named(name: str, text: str) -> None:
    with pytest.raises(ValueError, match=r"pieces not in the vocabulary: \['(x|\u00e9)'\]"):
        build_builtin_tokenizer(name).encode(text)


@pytest.mark.parametrize("name", ["digits", "letters", "bytes"])
def test_vocabularies_without_unk_declare_none(name: str, saved_dirs: dict[str, Path]) -> None:
    """A declared but absent <unk> makes `tokenizers` fail inside and vLLM warn."""
    saved = json.loads((saved_dirs[name] / "tokenizer.json").read_text())
    assert "<unk>" not in json.dumps(saved["model"])
    assert build_builtin_tokenizer(name).unk_token_id is None


@pytest.mark.parametrize("name", ["digits", "letters", "words", "bytes"])
def test_saved_dir_loads_back_identically(name: str, saved_dirs: dict[str, Path]) -> None:
    built = build_builtin_tokenizer(name)
    loaded = load_tokenizer(saved_dirs[name])
    assert isinstance(loaded, Tokenizer)
    assert loaded.vocab_size == built.vocab_size
    assert dict(loaded.special_tokens) == dict(built.special_tokens)
    assert loaded.chat_template == built.chat_template
    for text in SAMPLE_TEXTS[name]:
        assert loaded.encode(text) == built.encode(text)
        assert loaded.decode(loaded.encode(text)) == built.decode(built.encode(text))


@pytest.mark.parametrize("name", ["digits", "letters", "words", "bytes"])
def test_transformers_loads_saved_dir_with_same_ids(
    name: str, saved_dirs: dict[str, Path], auto_tokenizers: dict[str, Any]
) -> None:
    reference = auto_tokenizers[name]
    tokenizer = load_tokenizer(saved_dirs[name])
    assert len(reference) == tokenizer.vocab_size
    assert reference.eos_token_id == tokenizer.eos_token_id
    assert reference.pad_token_id == tokenizer.pad_token_id
    for text in SAMPLE_TEXTS[name]:
        ids = tokenizer.encode(text)
        assert reference.encode(text, add_special_tokens=False) == ids
        assert reference.decode(ids) == tokenizer.decode(ids)


@pytest.mark.parametrize("name", ["digits", "letters", "words", "bytes"])
def test_transformers_chat_template_renders_chatml(
    name: str, saved_dirs: dict[str, Path], auto_tokenizers: dict[str, Any]
) -> None:
    reference = auto_tokenizers[name]
    tokenizer = load_tokenizer(saved_dirs[name])
    prompt = reference.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == CHATML + "<|im_start|>assistant\n"
    full = reference.apply_chat_template(MESSAGES, tokenize=False)
    assert full == CHATML + "<|im_start|>assistant\n3<|im_end|>\n"
    ids = tokenizer.encode(full)
    assert ids.count(tokenizer.eos_token_id) == 3
    assert tokenizer.decode(ids) == full
