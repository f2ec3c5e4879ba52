"""Multimodal (conditional-generation) checkpoints: the text model is loaded, the other parts'
tensors ("passthrough") are kept off the model and written back, bitwise, by every export.

The checkpoint here is crafted: a tiny Qwen3 text model in transformers 5's composite layout
(`model.language_model.*`, a composite config.json) beside made-up vision and MTP tensors of
several dtypes, in two shards. tests/checkpoint/test_qwen3_5_composite.py does the same with
transformers' own Qwen3.5 conditional-generation models.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from temper.checkpoint.hf import load_pretrained, save_pretrained
from temper.checkpoint.merge import save_merged_pretrained
from temper.checkpoint.model_source import ModelSource, init_model_dir
from temper.checkpoint.peft import peft_adapter_tensors
from temper.client.sampler_weights import load_sampler_directory, save_sampler_weights
from temper.job.memory_plan import model_config
from temper.models.lora import LoraConfig, apply_lora

TEXT_PREFIX = "model.language_model."


def _extras() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {
        "model.visual.patch_embed.proj.weight": torch.randn(8, 3, 2, 4, 4, generator=generator),
        "model.visual.blocks.0.norm1.bias": torch.randn(8, generator=generator).bfloat16(),
        "model.visual.pos_embed.weight": torch.randn(16, 8, generator=generator),
        "mtp.fc.weight": torch.randn(4, 4, generator=generator).half(),
    }


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """A text-only tiny Qwen3 directory and the same model as a multimodal checkpoint."""
    root = tmp_path_factory.mktemp("composite")
    text_dir = root / "text"
    init_model_dir(text_dir, size="tiny", tokenizer="digits", seed=1)
    text_config = json.loads((text_dir / "config.json").read_text())
    composite_config = {
        "architectures": ["Qwen3ForConditionalGeneration"],
        "model_type": "qwen3_vl_like",
        "text_config": {k: v for k, v in text_config.items() if k != "architectures"},
        "vision_config": {"depth": 1, "hidden_size": 8, "out_hidden_size": 64},
        "image_token_id": 7,
        "tie_word_embeddings": text_config["tie_word_embeddings"],
        "dtype": "float32",
    }
    composite_config["text_config"]["rope_parameters"]["mrope_section"] = [2, 3, 3]
    text_tensors = _stored(text_dir)
    renamed = {
        TEXT_PREFIX + key.removeprefix("model.") if key.startswith("model.") else key: value
        for key, value in text_tensors.items()
    }
    composite_dir = root / "composite"
    composite_dir.mkdir()
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": {k: renamed[k] for k in names[::2]}}
    shards["model-00002-of-00002.safetensors"] = {k: renamed[k] for k in names[1::2]}
    shards["model-00002-of-00002.safetensors"].update(_extras())
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(composite_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (composite_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (composite_dir / "config.json").write_text(json.dumps(composite_config))
    for path in text_dir.iterdir():
        if "token" in path.name:
            shutil.copy(path, composite_dir / path.name)
    return {"text": text_dir, "composite": composite_dir}


def _assert_same_weights(actual: torch.nn.Module, expected: torch.nn.Module) -> None:
    expected_state = expected.state_dict()
    assert actual.state_dict().keys() == expected_state.keys()
    for key, value in actual.state_dict().items():
        assert torch.equal(value, expected_state[key]), key


def _assert_passthrough_kept(directory: Path) -> None:
    stored = _stored(directory)
    for key, value in _extras().items():
        assert stored[key].dtype == value.dtype and torch.equal(stored[key], value), key


def test_the_text_model_loads_and_holds_no_passthrough_tensor(dirs):
    text = load_pretrained(dirs["text"])
    model = load_pretrained(dirs["composite"])
    _assert_same_weights(model, text)
    composite = model.config.hf_composite
    assert {tensor.hf_key for tensor in composite.passthrough} == set(_extras())
    assert composite.hf_config["vision_config"]["depth"] == 1
    assert not any("visual" in key or "mtp" in key for key in model.state_dict())
    # The plan and the server read the text config of a composite directory too.
    assert model_config(str(dirs["composite"])).dim == text.config.dim


@pytest.mark.parametrize("max_shard_bytes", [2**30, 20_000], ids=["one-file", "sharded"])
def test_export_writes_the_same_architecture_back_bitwise(dirs, tmp_path, max_shard_bytes):
    model = load_pretrained(dirs["composite"])
    with torch.no_grad():
        model.norm.weight.add_(1.0)  # a trained text weight
    out = save_pretrained(model, tmp_path / "out", max_shard_bytes=max_shard_bytes)
    assert (out / "model.safetensors.index.json").is_file() == (max_shard_bytes < 2**30)
    _assert_passthrough_kept(out)
    stored = _stored(out)
    assert torch.equal(stored[f"{TEXT_PREFIX}norm.weight"], model.norm.weight)
    assert not any(key.startswith("model.layers.") for key in stored)

    source = json.loads((dirs["composite"] / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    for key in ("architectures", "model_type", "vision_config", "image_token_id"):
        assert config[key] == source[key], key
    # Keys the family does not write stay; the text model's own are its own.
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert config["text_config"]["hidden_size"] == model.config.dim
    assert "architectures" not in config["text_config"]

    again = load_pretrained(out)
    _assert_same_weights(again, model)


def test_text_layout_writes_the_text_model_alone(dirs, tmp_path):
    model = load_pretrained(dirs["composite"])
    out = save_pretrained(model, tmp_path / "out", layout="text")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert _stored(out).keys() == _stored(dirs["text"]).keys()
    with pytest.raises(ValueError, match="layout must be 'as_loaded' or 'text'"):
        save_pretrained(model, tmp_path / "bad", layout="vision")


def test_merged_lora_and_sampler_weights_keep_the_passthrough(dirs, tmp_path):
    model = load_pretrained(dirs["composite"])
    apply_lora(model, LoraConfig(rank=2, seed=3))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B"):
                parameter.normal_(generator=torch.Generator().manual_seed(len(name)))
    _assert_passthrough_kept(save_merged_pretrained(model, tmp_path / "merged"))

    tokenizer = ModelSource.Config(path=str(dirs["composite"])).build().tokenizer
    full = load_pretrained(dirs["composite"])
    save_sampler_weights(
        tmp_path / "sampler", model=full, tokenizer=tokenizer, base_model="x", lora=None
    )
    _assert_passthrough_kept(tmp_path / "sampler")
    loaded = load_sampler_directory(tmp_path / "sampler", name="s", device="cpu", dtype="float32")
    assert loaded.model.config.hf_composite is not None

    # A PEFT adapter holds the adapters alone, under the checkpoint's own module names.
    adapters = peft_adapter_tensors(model)
    assert adapters and all(key.startswith("base_model.model.") for key in adapters)
    layers = [key for key in adapters if ".layers." in key]
    assert layers and all(f".{TEXT_PREFIX}layers." in key for key in layers)
    assert not any("visual" in key for key in adapters)


def test_deferred_load_reads_the_text_tensors_from_the_composite(dirs):
    source = ModelSource.Config(path=str(dirs["composite"]), weights="deferred").build()
    source.deferred_weights.materialize(source.model, lora=None)
    _assert_same_weights(source.model, load_pretrained(dirs["text"]))


def test_export_refuses_when_the_source_is_gone_and_writes_nothing(dirs, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(dirs["composite"], copy)
    model = load_pretrained(copy)
    (copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="multimodal checkpoint"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # An unknown text tensor is refused as in a text-only checkpoint.
    shards = sorted(dirs["composite"].glob("*.safetensors"))
    tensors = load_file(str(shards[0]))
    tensors[f"{TEXT_PREFIX}layers.0.mystery.weight"] = torch.zeros(2)
    bad = tmp_path / "bad"
    shutil.copytree(dirs["composite"], bad)
    save_file(tensors, str(bad / shards[0].name))
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"][f"{TEXT_PREFIX}layers.0.mystery.weight"] = shards[0].name
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="mystery"):
        load_pretrained(bad)


def test_a_composite_without_text_tensors_under_the_prefix_is_refused(dirs, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(dirs["composite"] / "config.json", bad / "config.json")
    with safe_open(str(dirs["text"] / "model.safetensors"), "pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no tensor is stored under 'model\.language_model\.'"):
        load_pretrained(bad)


def test_a_training_client_saves_sampler_weights_with_the_passthrough(dirs, tmp_path):
    from temper import AdamParams, Datum, ModelInput, ServiceClient

    service = ServiceClient(storage_dir=tmp_path / "storage")
    client = service.create_training_client(str(dirs["composite"]))
    tokens = [1, 2, 3, 4]
    inputs = {"target_tokens": [*tokens[1:], 1], "weights": [1.0] * 4}
    datum = Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs=inputs)
    client.forward_backward([datum], "cross_entropy").result()
    client.optim_step(AdamParams(learning_rate=1e-2)).result()
    path = client.save_weights_for_sampler("trained").result().path
    _, directory = service.storage.existing(path)
    _assert_passthrough_kept(directory)
    trained = load_pretrained(directory)
    assert not torch.equal(trained.norm.weight, load_pretrained(dirs["text"]).norm.weight)
