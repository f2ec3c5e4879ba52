"""A local tokenizer directory with Qwen3.5's special tokens at their real ids (no download).

Qwen3.5 (and Qwen3.6) number their byte-level BPE vocabulary 0 .. 248043 and add 33 tokens
from 248044 on; the model's embedding has 248320 rows. Here a small BPE is trained on a few
chat-like lines (so "\\n\\n", "assistant" and friends merge, as in the real vocabulary), the
rest of 0 .. 248043 is filled with pieces no text produces, and the added tokens follow in
Qwen3.5's order, with Qwen3.5's split regex in front of the byte-level step.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

QWEN3_5_MODEL_VOCAB = 248320
"""Rows of the model's embedding (vocab_size in config.json)."""
QWEN3_5_BPE_SIZE = 248044
"""Ids of the byte-level BPE; the added tokens start here."""

QWEN3_5_ADDED_TOKENS = (
    ("<|endoftext|>", True),  # 248044
    ("<|im_start|>", True),  # 248045
    ("<|im_end|>", True),  # 248046
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),  # 248053
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),  # 248056
    ("<|video_pad|>", True),
    ("<tool_call>", False),  # 248058
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),  # 248066
    ("</tool_response>", False),
    ("<think>", False),  # 248068
    ("</think>", False),  # 248069
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),  # 248076
)
"""(content, special) of each added token, in id order from QWEN3_5_BPE_SIZE."""
QWEN3_5_IDS = {content: QWEN3_5_BPE_SIZE + i for i, (content, _) in enumerate(QWEN3_5_ADDED_TOKENS)}

_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TRAINING_TEXT = [
    "system\nYou are a helpful assistant.\n\nuser\nWhat is the weather in Paris today?\n\n",
    "assistant\nLet me think about it.\n\nThe answer is 42.\n\n",
    'function=get_weather parameter=city {"city": "Paris", "days": 2} tools tool_response\n\n',
    "  two leading spaces, a tab\tand\nnew lines\n\n caf\u00e9 \u4e16\u754c",
]


def write_qwen3_5_like_dir(directory: Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json of the tokenizer above to `directory`."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_TRAINING_TEXT * 4, trainer=trainer)
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    # Pieces no merge produces, so that the added tokens get Qwen3.5's ids (tokenizers numbers
    # added tokens after the model's vocabulary, in the order listed).
    vocab.update({f"<|unused_{i}|>": i for i in range(len(vocab), QWEN3_5_BPE_SIZE)})
    spec["added_tokens"] = [
        {
            "id": QWEN3_5_IDS[content],
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for content, special in QWEN3_5_ADDED_TOKENS
    ]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 262144,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory
