"""The SFT job end to end through `temper train`: a task recipe and a conversation recipe learn,
write their outputs, and bad input fails cleanly before training."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

from recipes.sft_conversations import sft_conversations
from temper.checkpoint.hf import load_pretrained
from temper.cli import main
from temper.config import load_config
from temper.observability import read_metrics
from temper.tokenizer import load_tokenizer
from temper.tokenizer.builtin import CHATML_TEMPLATE
from temper.tokenizer.renderers import role_colon


def test_smoke_recipe_learns_and_writes_run_dir(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["train", "sum_digits_smoke", "--run-dir", str(run_dir), "--seed", "1"]
    argv += ["--metrics.display", "none", "--eval_problems", "32"]
    assert main(argv) == 0
    # The closing lines name the outputs whole, however narrow the console: a copyable path.
    out = capsys.readouterr().out
    assert f"sample them: temper sample --model {run_dir} --prompt ...\n" in out, out
    assert f"plots: {run_dir / 'plots' / 'index.html'}\n" in out, out

    records = read_metrics(run_dir / "metrics.jsonl")
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 60
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # From random init the answer loss starts near ln(29) = 3.4; 60 steps bring it well down.
    assert first > 2.5 and last < 0.75 * first, (first, last)
    assert [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert records[0]["eval/initial_loss"] > last  # the held-out loss before training

    loaded = load_config(run_dir / "config.json")
    assert loaded.recipe == "sum_digits_smoke"
    assert loaded.config.seed == 1 and loaded.config.eval_problems == 32
    assert (run_dir / "plots" / "learning.png").is_file()
    assert load_pretrained(run_dir / "model").config.vocab_size == 29
    assert not (run_dir / "model" / "sampler.json").exists()
    assert list((run_dir / "checkpoints").glob("run-*/sampler_weights/final/sampler.json"))
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["config"]["steps"] == 60


def test_missing_model_directory_is_a_clean_error_and_leaves_no_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["train", "sum_digits_smoke", "--run-dir", str(run_dir)]
    assert main([*argv, "--model.base_model", str(tmp_path / "nowhere")]) == 1
    assert "neither a model directory nor a named size" in capsys.readouterr().err
    assert not run_dir.exists()


def test_config_file_reproduces_the_run_exactly(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    argv = ["--metrics.display", "none", "--export", "none", "--steps", "8", "--eval_every", "4"]
    assert main(["train", "sum_digits_smoke", "--run-dir", str(first), *argv]) == 0
    config_file = str(first / "config.json")
    assert main(["train", "--config-file", config_file, "--run-dir", str(second)]) == 0

    def curves(run_dir):
        return [
            {k: v for k, v in record.items() if not k.startswith(("time", "train/tokens"))}
            for record in read_metrics(run_dir / "metrics.jsonl")
        ]

    assert curves(first) == curves(second)
    assert (first / "config.json").read_text() == (second / "config.json").read_text()


def test_conversation_recipe_heldout_loss_falls(tmp_path, capsys):
    config = sft_conversations()
    config.steps, config.eval_every = 40, 20
    config.metrics.display = "none"
    config.export = "hf"
    result = config.build().run(run_dir=tmp_path / "run")
    # From random init the loss per assistant token is about ln(vocab size) = 6.6.
    assert result.initial_heldout_loss > 5.0
    assert result.heldout_loss < 0.35 * result.initial_heldout_loss, result
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    eval_losses = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(eval_losses) == 2 and eval_losses[-1] == result.heldout_loss
    assert {"train/loss", "optim/lr", "optim/grad_norm", "eval/accuracy"} <= {
        key for record in records for key in record
    }
    # The export's chat template is the format trained on; the checkpoint's files, hard-linked
    # into the export, keep the base tokenizer's.
    assert load_tokenizer(result.model_dir).chat_template == role_colon.CHAT_TEMPLATE
    checkpoint_dir = next((tmp_path / "run" / "checkpoints").glob("*/sampler_weights/final"))
    assert load_tokenizer(checkpoint_dir).chat_template == CHATML_TEMPLATE
    # The hint to sample the run renders prompts in the format trained on.
    hint = f"sample them: temper sample --model {tmp_path / 'run'} --chat role_colon --prompt ..."
    assert hint in capsys.readouterr().out


def test_bad_dataset_fails_before_training_with_the_line(tmp_path, capsys):
    good = (
        '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}'
    )
    dataset = tmp_path / "chats.jsonl"
    dataset.write_text(f"{good}\n{{not json\n{good}\n")
    run_dir = tmp_path / "run"
    argv = ["train", "sft_conversations", "--run-dir", str(run_dir)]
    assert main([*argv, "--conversations.path", str(dataset)]) == 1
    assert f"{dataset}:2: malformed JSON" in capsys.readouterr().err
    assert not run_dir.exists()
    assert main([*argv, "--conversations.path", str(tmp_path / "missing.jsonl")]) == 1
    assert "missing.jsonl" in capsys.readouterr().err
    assert not run_dir.exists()


def test_sample_dataset_is_what_its_generator_writes():
    data_dir = Path(__file__).resolve().parents[2] / "data"
    generator = runpy.run_path(str(data_dir / "make_conversations_sample.py"))
    lines = (data_dir / "conversations_sample.jsonl").read_text().splitlines()
    expected = generator["conversations"](count=300, seed=0)
    assert [json.loads(line)["messages"] for line in lines] == expected


def test_text_outside_the_vocabulary_is_named_before_training(tmp_path, capsys):
    messages = [
        {"role": "user", "content": "Swap cat"},
        {"role": "assistant", "content": "Cat zebra"},
    ]
    unknown = json.dumps({"messages": messages})
    dataset = tmp_path / "chats.jsonl"
    dataset.write_text(f"{unknown}\n{unknown}\n")
    run_dir = tmp_path / "run"
    argv = ["train", "sft_conversations", "--run-dir", str(run_dir)]
    assert main([*argv, "--conversations.path", str(dataset)]) == 1
    error = capsys.readouterr().err
    assert f"{dataset}:" in error and "not in the vocabulary: ['Swap', 'zebra']" in error
    assert not run_dir.exists()
