"""`temper init-model` for the Qwen3.5 families: the directory loads in Temper and in
transformers with the same logits."""

from __future__ import annotations

import pytest
import torch

from temper.checkpoint.model_source import ModelSource
from temper.commands.model_dir import init_model
from temper.models.qwen3_5 import Qwen3_5
from temper.models.qwen3_5_moe import Qwen3_5Moe

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("family", "model_cls", "hf_class"),
    [
        ("qwen3_5", Qwen3_5, "Qwen3_5ForCausalLM"),
        ("qwen3_5_moe", Qwen3_5Moe, "Qwen3_5MoeForCausalLM"),
    ],
)
def test_init_model_writes_a_directory_transformers_loads(tmp_path, family, model_cls, hf_class):
    from transformers import AutoModelForCausalLM

    assert init_model(tmp_path / "m", family=family, size="tiny", tokenizer="digits") == 0
    model = ModelSource.Config(path=str(tmp_path / "m")).build().model.eval()
    assert isinstance(model, model_cls)
    assert model.config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").float().eval()
    assert type(reloaded).__name__ == hf_class
    tokens_BT = torch.randint(0, model.config.vocab_size, (2, 70))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens_BT).logits, model(tokens_BT), rtol=0, atol=1e-5)
