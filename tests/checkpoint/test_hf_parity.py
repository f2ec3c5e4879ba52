"""HF parity: logits of a HF checkpoint loaded into Temper, and export back to HF."""

from __future__ import annotations

import json

import pytest
import torch

from temper.checkpoint.hf import load_pretrained, save_pretrained
from tests.models.hf_reference import save_hf, tiny_hf_qwen3

pytest.importorskip("transformers")


def _right_padded_batch(*, vocab_size: int, lengths: list[int], pad_id: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    max_len = max(lengths)
    tokens_BT = torch.full((len(lengths), max_len), pad_id)
    mask_BT = torch.zeros(len(lengths), max_len, dtype=torch.long)
    for row, length in enumerate(lengths):
        tokens_BT[row, :length] = torch.randint(0, vocab_size, (length,), generator=generator)
        mask_BT[row, :length] = 1
    return tokens_BT, mask_BT


@pytest.mark.parametrize(
    ("tie", "attention_bias", "shard"),
    [(True, False, False), (False, True, True)],
    ids=["tied-single-file", "untied-bias-sharded"],
)
def test_loaded_hf_checkpoint_matches_hf_logits(tmp_path, tie, attention_bias, shard):
    hf_model = tiny_hf_qwen3(tie=tie, attention_bias=attention_bias)
    save_hf(hf_model, tmp_path, **({"max_shard_size": "100KB"} if shard else {}))
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_pretrained(tmp_path, dtype=torch.float32).eval()

    for seed, lengths in enumerate([[17], [5, 23, 11, 23], [1, 9, 40]]):
        tokens_BT, mask_BT = _right_padded_batch(
            vocab_size=97, lengths=lengths, pad_id=0, seed=seed
        )
        with torch.no_grad():
            expected_BTV = hf_model(input_ids=tokens_BT, attention_mask=mask_BT).logits
            actual_BTV = model(tokens_BT)
        real = mask_BT.bool()
        torch.testing.assert_close(actual_BTV[real], expected_BTV[real], rtol=0, atol=1e-5)


def test_export_loads_in_transformers_exactly(tmp_path):
    from transformers import AutoModelForCausalLM

    source = tiny_hf_qwen3(tie=False, attention_bias=True, seed=3)
    save_hf(source, tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")
    save_pretrained(model, tmp_path / "export")

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").float().eval()
    expected = source.state_dict()
    actual = reloaded.state_dict()
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key

    tokens_BT = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens_BT).logits, model(tokens_BT), rtol=0, atol=1e-5)


def test_export_round_trip_through_temper_is_bitwise(tmp_path):
    source = load_pretrained(save_hf(tiny_hf_qwen3(tie=True), tmp_path / "hf"))
    save_pretrained(source, tmp_path / "a", max_shard_bytes=50_000)
    assert (tmp_path / "a" / "model.safetensors.index.json").is_file()
    again = load_pretrained(tmp_path / "a")
    for (key, expected), (_, actual) in zip(
        source.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(actual, expected), key
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]


def test_bf16_load_matches_hf_bf16(tmp_path):
    hf_model = tiny_hf_qwen3(tie=True)
    save_hf(hf_model, tmp_path)
    model = load_pretrained(tmp_path, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    tokens_BT = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model.to(torch.bfloat16)(input_ids=tokens_BT).logits.float()
        actual = model(tokens_BT).float()
    # bf16 has ~3 significant digits; same op order keeps the two close.
    torch.testing.assert_close(actual, expected, rtol=0, atol=2e-2)
