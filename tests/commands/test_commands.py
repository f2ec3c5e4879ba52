"""`temper init-model` and `temper plot` through the real entry point."""

from __future__ import annotations

import json

from temper.checkpoint.hf import load_pretrained
from temper.cli import main


def test_init_model_writes_a_loadable_directory(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["init-model", str(out), "--tokenizer", "letters", "--seed", "4"]) == 0
    assert "99 tokens" in capsys.readouterr().out
    model = load_pretrained(out)
    assert model.config.vocab_size == 99
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def test_init_model_writes_a_llama_directory(tmp_path, capsys):
    out = tmp_path / "llama"
    assert main(["init-model", str(out), "--family", "llama", "--tokenizer", "letters"]) == 0
    assert "tiny llama model" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_parameters"]["rope_type"] == "llama3"
    model = load_pretrained(out)
    assert type(model).__name__ == "Llama" and model.config.vocab_size == 99


def test_init_model_writes_a_qwen3_moe_directory(tmp_path, capsys):
    out = tmp_path / "moe"
    assert main(["init-model", str(out), "--family", "qwen3_moe", "--tokenizer", "letters"]) == 0
    assert "tiny qwen3_moe model" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"]) == (8, 2)
    model = load_pretrained(out)
    assert type(model).__name__ == "Qwen3Moe" and model.config.vocab_size == 99


def test_init_model_refuses_to_clobber(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["init-model", str(out)]) == 0
    before = (out / "model.safetensors").read_bytes()
    assert main(["init-model", str(out), "--seed", "9"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before
    assert main(["init-model", str(out), "--seed", "9", "--overwrite"]) == 0
    assert (out / "model.safetensors").read_bytes() != before


def test_init_model_unknown_size_is_a_clean_error(tmp_path, capsys):
    assert main(["init-model", str(tmp_path / "x"), "--size", "3B"]) == 2
    assert "unknown qwen3 size '3B'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_plot_writes_pngs_and_their_index(tmp_path, capsys):
    lines = [{"step": s, "time": 0.0, "train/loss": 1.0 / (s + 1)} for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["plot", str(tmp_path)]) == 0
    *figures, index = capsys.readouterr().out.split()
    assert figures and all(path.endswith(".png") for path in figures)
    assert index == str(tmp_path / "plots" / "index.html")
    assert (tmp_path / "plots" / "learning.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_metrics_is_a_clean_error(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics file" in capsys.readouterr().err
