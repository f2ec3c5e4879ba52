"""Model directories: init-model output loads in Temper and HF; bad directories are explained."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from temper.checkpoint.hf import empty_pretrained, load_pretrained
from temper.checkpoint.model_source import ModelSource, init_model_dir
from temper.checkpoint.sharded_load import DeferredWeights
from temper.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models") / "tiny"
    init_model_dir(directory, size="tiny", tokenizer="digits", seed=3)
    return directory


def test_init_model_dir_round_trips(model_dir):
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in model_dir.iterdir()
    }
    random_model = ModelSource.Config(size="tiny", tokenizer="digits", seed=3).build()
    loaded = ModelSource.Config(path=str(model_dir)).build()
    for (key, expected), (_, actual) in zip(
        random_model.model.state_dict().items(), loaded.model.state_dict().items(), strict=True
    ):
        assert torch.equal(actual, expected), key
    assert loaded.tokenizer.encode("123=6") == random_model.tokenizer.encode("123=6")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["eos_token_id"] == loaded.tokenizer.eos_token_id


def _load_deferred(model_dir):
    """The sharded loader's path on one process: a meta model filled by DeferredWeights."""
    model = empty_pretrained(model_dir, device="meta")
    DeferredWeights(device=torch.device("cpu"), model_dir=model_dir).materialize(model, lora=None)
    return model


LOADERS = {"load_pretrained": load_pretrained, "deferred": _load_deferred}


@pytest.mark.parametrize("use_path", [True, False], ids=["directory", "random"])
def test_deferred_weights_fill_a_meta_model_like_a_loaded_one(model_dir, use_path):
    config = ModelSource.Config(path=str(model_dir) if use_path else None, seed=3)
    loaded = config.build()
    deferred = dataclasses.replace(config, weights="deferred").build()
    assert deferred.device.type == "meta" and loaded.deferred_weights is None
    deferred.deferred_weights.materialize(deferred.model, lora=None)
    expected, actual = loaded.model.state_dict(), deferred.model.state_dict()
    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[key], expected[key]) for key in expected)


def test_transformers_loads_the_model_directory(model_dir):
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ours = load_pretrained(model_dir).eval()
    tokens = hf_tokenizer("4821=")["input_ids"]
    assert tokens == load_tokenizer(model_dir).encode("4821=")
    with torch.no_grad():
        torch.testing.assert_close(
            ours(torch.tensor([tokens])), hf_model(torch.tensor([tokens])).logits, rtol=0, atol=1e-5
        )


def test_missing_files_are_listed(tmp_path, model_dir):
    with pytest.raises(FileNotFoundError, match=r"missing: config\.json, model\.safetensors"):
        load_pretrained(tmp_path)
    nowhere = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as missing:
        load_pretrained(nowhere)
    assert str(missing.value) == (
        f"model directory {nowhere} is missing: the directory itself (no such directory)"
    )


def test_unsupported_architecture_is_named(tmp_path, model_dir):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (tmp_path / "config.json").write_text(json.dumps(config))
    supported = r"supported architectures: Qwen3ForCausalLM .*, LlamaForCausalLM"
    with pytest.raises(ValueError, match=rf"'MistralForCausalLM'.*{supported}"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("load", LOADERS.values(), ids=LOADERS.keys())
def test_wrong_tensor_shape_names_tensor_and_both_shapes(tmp_path, model_dir, load):
    (tmp_path / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    key = "model.layers.1.mlp.up_proj.weight"
    tensors[key] = torch.zeros(7, 128)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{key}.*shape \(7, 128\).*expects \(384, 128\)"):
        load(tmp_path)


@pytest.mark.parametrize("load", LOADERS.values(), ids=LOADERS.keys())
def test_missing_and_unexpected_tensors_are_listed(tmp_path, model_dir, load):
    (tmp_path / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks tensors \['model.norm.weight'\]"):
        load(tmp_path)
    tensors["model.norm.weight"] = torch.ones(128)
    tensors["model.extra.weight"] = torch.ones(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"not used by Qwen3ForCausalLM: \['model.extra.weight'\]"):
        load(tmp_path)


def test_unknown_size_is_named():
    with pytest.raises(ValueError, match=r"ModelSource.Config.size: unknown qwen3 size 'big'"):
        ModelSource.Config(size="big").build()
