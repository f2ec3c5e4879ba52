"""StopStringMatcher against the obvious oracle: decode every prefix and look for the strings.

The tokenizers cover the decoders that matter: the built-in word-level vocabularies, a
byte-level BPE (GPT-2/Qwen style, tokens that end inside a UTF-8 character) and a
SentencePiece-style BPE with byte fallback (whose decoder strips the first token's leading
space), each trained here on a few sentences with non-ASCII text.
"""

from __future__ import annotations

import random

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from temper.sampler.stopping import StopStringMatcher, find_stop
from temper.tokenizer import Tokenizer, build_builtin_tokenizer

SENTENCES = [
    "Hello world!\n\nUser: how are you?\n\nAssistant: fine, thanks.",
    "Gr\u00fc\u00dfe aus M\u00fcnchen, caf\u00e9 cr\u00e8me.",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002",
    "emoji \U0001f642 here and \u20ac 5",
]


def _wrap(backend: tokenizers.Tokenizer, name: str) -> Tokenizer:
    return Tokenizer(backend, config={"eos_token": "<|im_end|>"}, name_or_path=name)


def _byte_level_bpe() -> Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(SENTENCES * 3, trainer=trainer)
    return _wrap(backend, "test:byte-level-bpe")


def _sentencepiece_bpe() -> Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE(byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<|im_end|>", *byte_tokens], show_progress=False
    )
    backend.train_from_iterator(SENTENCES * 3, trainer=trainer)
    return _wrap(backend, "test:sentencepiece-bpe")


def _pieces_tokenizer(pieces: list[str]) -> Tokenizer:
    """A word-level vocabulary of exactly `pieces`, so a test chooses the token boundaries."""
    vocab = {piece: i for i, piece in enumerate(["<|im_end|>", *pieces])}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=None))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([tokenizers.AddedToken("<|im_end|>", special=True)])
    return _wrap(backend, "test:pieces")


@pytest.fixture(scope="module")
def tokenizer_by_name() -> dict[str, Tokenizer]:
    return {
        "letters": build_builtin_tokenizer("letters"),
        "words": build_builtin_tokenizer("words"),
        "byte-level-bpe": _byte_level_bpe(),
        "sentencepiece-bpe": _sentencepiece_bpe(),
    }


def _oracle(token_ids: list[int], stops: list[str], tokenizer: Tokenizer) -> int | None:
    for index in range(len(token_ids)):
        text = tokenizer.decode(token_ids[: index + 1], skip_special_tokens=False)
        if any(stop in text for stop in stops):
            return index + 1
    return None


def _pushes(stops: list[str], token_ids: list[int], tokenizer: Tokenizer) -> list[bool]:
    matcher = StopStringMatcher(stops, tokenizer=tokenizer)
    return [matcher.push(token_id) for token_id in token_ids]


def test_stop_string_spanning_token_boundaries():
    tokenizer = _pieces_tokenizer(["Hi", "\n", "\nUs", "er:", "er", ":"])
    ids = [tokenizer.token_to_id(p) for p in ["Hi", "\n", "\nUs", "er:", "Hi"]]
    assert _pushes(["\n\nUser:"], ids, tokenizer) == [False, False, False, True, True]
    ids = [tokenizer.token_to_id(p) for p in ["\n", "\nUs", "er", "\n", "\nUs", "er", ":"]]
    assert find_stop(ids, ["\n\nUser:"], tokenizer=tokenizer) == 7


def test_stop_string_across_single_character_tokens():
    letters = build_builtin_tokenizer("letters")
    ids = letters.encode("Sure.\n\nUser: hi")
    assert find_stop(ids, ["\n\nUser:"], tokenizer=letters) == len("Sure.\n\nUser:")
    assert find_stop(ids, ["\n\nAssistant:"], tokenizer=letters) is None


def test_stop_string_inside_one_token_and_several_strings():
    words = build_builtin_tokenizer("words")
    ids = words.encode("The cat can run on the road")
    assert [words.decode([i]) for i in ids[:3]] == ["The", " ", "cat"]
    matcher = StopStringMatcher(["road", "at"], tokenizer=words)
    assert [matcher.push(i) for i in ids[:3]] == [False, False, True]
    assert matcher.stopped and matcher.matched == "at"
    assert find_stop(ids, ["on", "run", "zebra"], tokenizer=words) == 7  # "run" before "on"


def test_special_tokens_are_matched_as_their_text():
    letters = build_builtin_tokenizer("letters")
    ids = [*letters.encode("ok"), letters.eos_token_id, *letters.encode("more")]
    assert find_stop(ids, ["<|im_end|>"], tokenizer=letters) == 3


def test_partial_utf8_characters(tokenizer_by_name):
    bpe = tokenizer_by_name["byte-level-bpe"]
    ids = bpe.encode("Gr\u00fc\u00dfe")
    pieces = [bpe.decode([i]) for i in ids]
    # The tokens split both two-byte characters, so single tokens decode to U+FFFD.
    assert any(piece.endswith("\ufffd") for piece in pieces), pieces
    for stop in ["\u00fc", "\u00df", "r\u00fc\u00df", "\u00dfe"]:
        expected = _oracle(ids, [stop], bpe)
        assert expected is not None
        assert find_stop(ids, [stop], tokenizer=bpe) == expected
    # A stop string followed by half a character in the same token stops at that token.
    first = bpe.decode(ids[:1])
    assert first.endswith("\ufffd") and find_stop(ids, [first[:-1]], tokenizer=bpe) == 1


def test_emoji_and_cjk_split_over_tokens(tokenizer_by_name):
    bpe = tokenizer_by_name["byte-level-bpe"]
    text = "\u65e5\u672c\U0001f642 \u20ac"
    ids = bpe.encode(text)
    assert len(ids) > len(text)  # characters span several tokens
    for stop in ["\u672c\U0001f642", "\U0001f642", " \u20ac", "\u20ac"]:
        assert find_stop(ids, [stop], tokenizer=bpe) == _oracle(ids, [stop], bpe)
    assert find_stop(ids, ["\u20ac"], tokenizer=bpe) == len(ids)


@pytest.mark.parametrize("name", ["letters", "words", "byte-level-bpe", "sentencepiece-bpe"])
def test_matches_oracle_on_random_streams(tokenizer_by_name, name):
    tokenizer = tokenizer_by_name[name]
    rng = random.Random(name)
    encoded = [tokenizer.encode(s) for s in SENTENCES] if "bpe" in name else []
    for case in range(150):
        if encoded and case % 2:
            ids = list(rng.choice(encoded))  # real text: stop strings well inside it
        else:
            ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 12))]
        full = tokenizer.decode(ids, skip_special_tokens=False)
        stops = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(max(1, len(full)))
            stops.append(full[start : start + rng.randint(1, 8)] or "x")
        if name == "sentencepiece-bpe":
            # The ByteFallback decoder turns a whole run of byte tokens into U+FFFD once the run
            # is invalid UTF-8, rewriting text already seen ("K:" becomes two U+FFFD); only a
            # stop string holding U+FFFD can tell, and the matcher does not chase that.
            stops = [stop.replace("\ufffd", "") or "x" for stop in stops]
        if rng.random() < 0.2:
            stops = ["\u00a7never\u00a7"]
        assert find_stop(ids, stops, tokenizer=tokenizer) == _oracle(ids, stops, tokenizer), (
            ids,
            stops,
        )


def test_decodes_a_short_window_per_token():
    letters = build_builtin_tokenizer("letters")
    lengths: list[int] = []

    class CountingTokenizer:
        def decode(self, token_ids, *, skip_special_tokens):
            lengths.append(len(token_ids))
            return letters.decode(token_ids, skip_special_tokens=skip_special_tokens)

    ids = letters.encode("the quick brown fox jumps over the lazy dog " * 12)
    matcher = StopStringMatcher(["lazy cat", "END"], tokenizer=CountingTokenizer())
    assert not any(matcher.push(i) for i in ids)
    assert max(lengths) <= 2 and len(lengths) <= 2 * len(ids)


def test_bad_stop_strings_are_rejected():
    letters = build_builtin_tokenizer("letters")
    with pytest.raises(TypeError, match="sequence of strings"):
        StopStringMatcher("stop", tokenizer=letters)
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""], tokenizer=letters)
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher([], tokenizer=letters)
