"""Loading HF tokenizer directories: a Qwen3-like byte-level BPE, errors, save round trips."""

from __future__ import annotations

import inspect
import json
import pickle
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

import temper.tokenizer
from temper.tokenizer import Tokenizer, load_tokenizer

QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "Hello world! The cat sat on the mat.",
    "  two leading spaces, a tab\tand\nnew lines\n\n",
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n42<|im_end|>",
    "unicode: caf\u00e9 \u4e16\u754c",
    "",
]


def write_qwen3_like_dir(directory: Path, *, config_overrides: dict | None = None) -> Path:
    """A tiny byte-level BPE trained on a few lines, with Qwen3's special-token config."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=QWEN3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TEXTS * 4, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    # The shape of Qwen3's real tokenizer_config.json, eos given as an AddedToken dict.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": "{{ messages[0]['content'] }}",
        "model_max_length": 131072,
        **(config_overrides or {}),
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@pytest.fixture
def qwen3_dir(tmp_path: Path) -> Path:
    return write_qwen3_like_dir(tmp_path / "qwen3")


def test_public_api_is_exported() -> None:
    assert set(temper.tokenizer.__all__) >= {
        "Tokenizer",
        "load_tokenizer",
        "build_builtin_tokenizer",
        "builtin_names",
    }
    assert list(inspect.signature(Tokenizer.encode).parameters) == [
        "self",
        "text",
        "add_special_tokens",
    ]
    assert list(inspect.signature(Tokenizer.decode).parameters) == [
        "self",
        "token_ids",
        "skip_special_tokens",
    ]


def test_loads_special_tokens_eos_pad_and_template(qwen3_dir: Path) -> None:
    tokenizer = load_tokenizer(qwen3_dir)
    assert dict(tokenizer.special_tokens) == {
        "<|endoftext|>": 0,
        "<|im_start|>": 1,
        "<|im_end|>": 2,
    }
    assert tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == 0
    assert tokenizer.bos_token_id is None
    assert tokenizer.unk_token_id is None
    assert tokenizer.chat_template == "{{ messages[0]['content'] }}"
    assert tokenizer.name_or_path == str(qwen3_dir)
    assert tokenizer.vocab_size == 300
    assert tokenizer.token_to_id("<|im_end|>") == 2
    assert tokenizer.token_to_id("not a token") is None
    assert tokenizer.id_to_token(1) == "<|im_start|>"


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_special_tokens_in_text(qwen3_dir: Path, text: str) -> None:
    tokenizer = Tokenizer.from_dir(qwen3_dir)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode_batch([text, text]) == [ids, ids]
    assert ids.count(tokenizer.eos_token_id) == text.count("<|im_end|>")
    stripped = tokenizer.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in stripped and "<|im_start|>" not in stripped


def test_matches_transformers_auto_tokenizer(qwen3_dir: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(qwen3_dir, local_files_only=True)
    tokenizer = load_tokenizer(qwen3_dir)
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=False)
        assert tokenizer.encode(text) == ids
        assert tokenizer.decode(ids) == reference.decode(ids)
    assert tokenizer.eos_token_id == reference.eos_token_id
    assert tokenizer.pad_token_id == reference.pad_token_id
    assert tokenizer.vocab_size == len(reference)


def test_save_round_trip_keeps_config_and_ids(qwen3_dir: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(qwen3_dir)
    tokenizer.save(tmp_path / "copy")
    copy = load_tokenizer(tmp_path / "copy")
    saved_config = json.loads((tmp_path / "copy" / "tokenizer_config.json").read_text())
    assert saved_config == json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    for text in TEXTS:
        assert copy.encode(text) == tokenizer.encode(text)
    assert copy.chat_template == tokenizer.chat_template
    assert dict(copy.special_tokens) == dict(tokenizer.special_tokens)


def test_chat_template_from_jinja_file_is_saved_into_config(tmp_path: Path) -> None:
    # transformers 5 writes the template to chat_template.jinja instead of the config.
    directory = write_qwen3_like_dir(tmp_path / "t5", config_overrides={"chat_template": None})
    (directory / "chat_template.jinja").write_text("{{ 'jinja' }}", encoding="utf-8")
    tokenizer = load_tokenizer(directory)
    assert tokenizer.chat_template == "{{ 'jinja' }}"
    tokenizer.save(tmp_path / "copy")
    saved_config = json.loads((tmp_path / "copy" / "tokenizer_config.json").read_text())
    assert saved_config["chat_template"] == "{{ 'jinja' }}"


def test_named_chat_templates_pick_default(tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    directory = write_qwen3_like_dir(tmp_path / "t", config_overrides={"chat_template": templates})
    assert load_tokenizer(directory).chat_template == "D"


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")


def test_missing_files_are_listed(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"\['tokenizer.json', 'tokenizer_config.json'\]"):
        load_tokenizer(tmp_path)
    directory = write_qwen3_like_dir(tmp_path / "q")
    (directory / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing \['tokenizer_config.json'\]"):
        load_tokenizer(directory)


def test_missing_or_unknown_eos_is_an_error(tmp_path: Path) -> None:
    directory = write_qwen3_like_dir(tmp_path / "none", config_overrides={"eos_token": None})
    with pytest.raises(ValueError, match="has no eos_token"):
        load_tokenizer(directory)
    directory = write_qwen3_like_dir(tmp_path / "bad", config_overrides={"eos_token": "<eos>"})
    with pytest.raises(ValueError, match="eos_token='<eos>', which is not in its vocabulary"):
        load_tokenizer(directory)


@pytest.mark.parametrize("bad_id", [300, 10**9, -1])
def test_decode_out_of_range_id_names_id_and_range(qwen3_dir: Path, bad_id: int) -> None:
    tokenizer = load_tokenizer(qwen3_dir)
    with pytest.raises(ValueError, match=rf"token id {bad_id} .* valid ids are 0 to 299"):
        tokenizer.decode([5, bad_id, 7])
    with pytest.raises(ValueError, match=rf"token id {bad_id} .* valid ids are 0 to 299"):
        tokenizer.id_to_token(bad_id)


def test_decode_of_nothing_is_empty(qwen3_dir: Path) -> None:
    assert load_tokenizer(qwen3_dir).decode([]) == ""


def test_pickles_for_spawned_processes(qwen3_dir: Path) -> None:
    tokenizer = load_tokenizer(qwen3_dir)
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy.encode(TEXTS[2]) == tokenizer.encode(TEXTS[2])
    assert dict(copy.special_tokens) == dict(tokenizer.special_tokens)
