"""tinker-cookbook's recipes train through `temper serve`, offline, on its default settings.

chat_sl, the RL loop on math_rl's arithmetic environment, DPO and the single-file rl_loop.

The recipe runs unmodified as `python -m tinker_cookbook.recipes.chat_sl.train` on the
conversations that ship with the cookbook. Its tokenizer is the model directory itself (the
cookbook loads a directory given as `model_name` with `AutoTokenizer`), and the `role_colon`
renderer needs nothing of a tokenizer but plain text, an EOS token and no BOS. No built-in
Temper vocabulary covers that text (it has `°`, `×`, `’`, ...), so the test trains a 512-token
byte-level BPE on the conversations and saves a random tiny Qwen3 with it.

Offline: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, and every non-loopback HTTP(S) request goes to
a closed local port (the cookbook's pricing download then fails at once and only warns).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import API_KEY, ServerProcess, start_server

NOT_INSTALLED = "tinker-cookbook is not installed (`make test` installs it: see the Makefile)"
pytest.importorskip("tinker_cookbook.recipes.chat_sl.train", reason=NOT_INSTALLED)
tinker_cookbook = pytest.importorskip("tinker_cookbook", reason=NOT_INSTALLED)

CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
NO_NETWORK = "http://127.0.0.1:9"  # nothing listens on port 9 (discard)


def build_chat_model_dir(directory: Path, *, texts: list[str], vocab_size: int) -> None:
    """A random tiny Qwen3 whose tokenizer is a byte-level BPE trained on `texts`."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from temper.checkpoint.hf import save_pretrained
    from temper.models.build import materialize
    from temper.models.registry import family
    from temper.tokenizer import Tokenizer

    eos = "<|endoftext|>"
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": eos,
        "pad_token": eos,
        "clean_up_tokenization_spaces": False,
    }
    tokenizer = Tokenizer(backend, config=config, name_or_path="bpe")
    model_config = dataclasses.replace(
        family("qwen3").sizes["tiny"], vocab_size=tokenizer.vocab_size
    )
    model = materialize(model_config, device="cpu", dtype="float32", seed=0)
    save_pretrained(model, directory, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rows = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines() if line]
    texts = [message["content"] for row in rows for message in row["messages"]]
    texts += ["System:", "User:", "Assistant:"]  # role_colon's headers
    # Deep enough that the SDK's "org/model/variant" tokenizer heuristic leaves it alone.
    directory = tmp_path_factory.mktemp("models") / "bpe-chat"
    build_chat_model_dir(directory, texts=texts, vocab_size=512)
    return directory


@pytest.fixture(scope="module")
def chat_server(chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("cookbook-server")
    process = start_server(chat_model_dir, root / "storage", root / "server.log")
    yield process
    process.stop()


def run_recipe(module: str, *, server: ServerProcess, cwd: Path, args: dict[str, object]):
    """Run a cookbook recipe module (chz arguments) against `server` with no network."""
    arguments = [f"base_url={server.base_url}", *(f"{key}={value}" for key, value in args.items())]
    return run_cookbook(["-m", module, *arguments], server=server, cwd=cwd)


# Runs `python ARGUMENTS` (a script, or -m module) and then leaves without the interpreter's
# shutdown: the SDK's daemon threads can still hold stderr then, and CPython aborts (SIGABRT,
# "could not acquire lock ... at interpreter shutdown") after the recipe has finished.
EXIT_WITHOUT_SHUTDOWN = """
import os, runpy, sys
code = 0
try:
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exit:
    code = exit.code if isinstance(exit.code, int) else (exit.code is not None)
except BaseException:
    import traceback
    traceback.print_exc()
    code = 1
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""


def run_cookbook(arguments: list[str], *, server: ServerProcess, cwd: Path) -> str:
    """Run `python ARGUMENTS` with the SDK pointed at `server` and no network; its output."""
    no_proxy = "127.0.0.1,localhost"
    env = {
        **os.environ,
        "TINKER_API_KEY": API_KEY,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        **{name: NO_NETWORK for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")},
        **{name: no_proxy for name in ("NO_PROXY", "no_proxy")},
    }
    result = subprocess.run(
        [sys.executable, "-c", EXIT_WITHOUT_SHUTDOWN, *arguments],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{arguments[:2]} failed:\n{output[-6000:]}"
    return output


def assert_checkpoints_on_server(log_path: Path, server: ServerProcess, names: list[str]) -> None:
    """The cookbook's checkpoints are the server's: state (and sampler weights) in --storage."""
    rows = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert [row["name"] for row in rows] == names
    assert rows[-1].keys() >= {"state_path", "sampler_path"}  # the final one is "both"
    for row in rows:
        for key in {"state_path", "sampler_path"} & row.keys():
            assert (server.storage / row[key].removeprefix("tinker://")).is_dir(), row[key]


def test_chat_sl_recipe_trains_offline_and_its_loss_goes_down(
    chat_server, chat_model_dir, tmp_path
):
    log_path = tmp_path / "chat_sl"
    steps = 10
    run_recipe(
        "tinker_cookbook.recipes.chat_sl.train",
        server=chat_server,
        cwd=tmp_path,
        args={
            "model_name": chat_model_dir,
            "renderer_name": "role_colon",
            "dataset": CONVERSATIONS,
            "log_path": log_path,
            "behavior_if_log_dir_exists": "delete",
            "batch_size": 8,
            "max_steps": steps,
            "learning_rate": 1e-2,
            "lora_rank": 8,
            "save_every": 5,
            "eval_every": 0,
            "infrequent_eval_every": 0,
        },
    )
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    losses = [row["train_mean_nll"] for row in metrics if "train_mean_nll" in row]
    assert len(losses) == steps
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, losses

    assert_checkpoints_on_server(log_path, chat_server, ["000005", "final"])


# math_rl's arithmetic environment on the cookbook's RL loop (`rl.train.main`, what the math_rl
# recipe runs). The recipe module itself also imports its other environments' graders
# (sympy, pylatexenc, math-verify), so the test drives the loop the way the recipe does.
RL_DRIVER = """
import asyncio, sys
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl.train import Config, main

model, base_url, log_path, loss_fn = sys.argv[1:]
dataset = ArithmeticDatasetBuilder(
    batch_size=4, group_size=4, n_batches=3, include_fewshot=True,
    model_name_for_tokenizer=model, renderer_name="role_colon",
)
asyncio.run(main(Config(
    model_name=model, renderer_name="role_colon", recipe_name="math_rl_arithmetic",
    dataset_builder=dataset, base_url=base_url, log_path=log_path,
    learning_rate=1e-3, lora_rank=8, max_tokens=5, loss_fn=loss_fn,
    eval_every=0, save_every=2, max_steps=3,
)))
"""


# stable_reinforce is the cookbook's default (math_rl, rl_loop, rubric, every async run): its
# samplers record stability info and every datum carries provenance spans.
@pytest.mark.parametrize("loss_fn", ["importance_sampling", "stable_reinforce"])
def test_cookbook_rl_loop_on_arithmetic_runs_offline(
    chat_server, chat_model_dir, tmp_path, loss_fn
):
    driver = tmp_path / "math_rl_arithmetic.py"
    driver.write_text(RL_DRIVER)
    log_path = tmp_path / "math_rl"
    run_cookbook(
        [str(driver), str(chat_model_dir), chat_server.base_url, str(log_path), loss_fn],
        server=chat_server,
        cwd=tmp_path,
    )
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "env/all/total_episodes" in row]  # (last: token totals)
    assert [row["step"] for row in steps] == [0, 1, 2]
    for row in steps:
        assert row["env/all/total_episodes"] == 16  # 4 groups of 4 samples
        assert 0 < row["tokens/sampled"] <= 16 * 5  # max_tokens 5; a stop string ends some
        # The server's sampled logprobs are the trainer's: no sampler/trainer mismatch.
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3
    assert_checkpoints_on_server(log_path, chat_server, ["000002", "final"])


# The cookbook's DPO trainer (`preference.train_dpo.main`, what `recipes.preference.dpo.train`
# runs; that CLI only offers hub datasets) on a local JSONL of labeled comparisons, read by the
# cookbook's own `ComparisonBuilderFromJsonl`. The reference sampling client is the snapshot
# taken before the first step; with a test set, `SamplerNLLEvaluator` takes a new snapshot at
# every step (eval_every=1), so the reference must outlive newer snapshots of its model.
DPO_DRIVER = """
import sys
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

model, base_url, log_path, train_path, test_path = sys.argv[1:]
dataset = DPODatasetBuilderFromComparisons(
    common_config=ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model, renderer_name="role_colon", max_length=256, batch_size=8,
    ),
    comparison_builder=ComparisonBuilderFromJsonl(train_path=train_path, test_path=test_path),
)
train_dpo.main(train_dpo.Config(
    log_path=log_path, model_name=model, recipe_name="recipe_preference_dpo",
    dataset_builder=dataset, renderer_name="role_colon", base_url=base_url,
    learning_rate=1e-2, lr_schedule="constant", dpo_beta=0.1, lora_rank=8,
    eval_every=1, save_every=3, infrequent_eval_every=0, ttl_seconds=None,
))
"""


def write_comparisons(path: Path, pairs: list[tuple[int, int]]) -> None:
    """Labeled comparisons: a sum answered (A, chosen) against a refusal (B, rejected)."""
    with path.open("w") as file:
        for a, b in pairs:
            comparison = {
                "prompt_conversation": [{"role": "user", "content": f"What is {a} plus {b}?"}],
                "completion_A": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}],
                "completion_B": [{"role": "assistant", "content": "I will not say."}],
            }
            file.write(json.dumps({"comparison": comparison, "label": "A"}) + "\n")


def test_cookbook_dpo_runs_offline_on_the_server_defaults(chat_server, chat_model_dir, tmp_path):
    pairs = [(a, b) for a in range(2, 9) for b in range(3, 10)][:56]
    write_comparisons(tmp_path / "train.jsonl", pairs[:48])  # 6 steps of 8 pairs
    write_comparisons(tmp_path / "test.jsonl", pairs[48:])
    driver = tmp_path / "dpo.py"
    driver.write_text(DPO_DRIVER)
    log_path = tmp_path / "dpo"
    arguments = [str(chat_model_dir), chat_server.base_url, str(log_path)]
    arguments += [str(tmp_path / "train.jsonl"), str(tmp_path / "test.jsonl")]
    run_cookbook([str(driver), *arguments], server=chat_server, cwd=tmp_path)

    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "dpo_loss" in row]
    assert [row["step"] for row in steps] == list(range(6))
    assert all(row["num_pairs"] == 8 for row in steps)
    # Step 0: the policy is the reference, so every log ratio is 0 and the loss is log 2.
    assert steps[0]["margin"] == pytest.approx(0, abs=1e-3)
    assert steps[0]["dpo_loss"] == pytest.approx(0.6931, abs=1e-3)
    # Later steps see new pairs. The policy has moved away from the reference (still the
    # initial weights, not a newer snapshot) towards the answers: chosen over rejected.
    # (A reference that followed the policy would keep every margin at 0.) About 0.7 to 2.1.
    for row in steps[2:]:
        assert row["accuracy"] == 1.0, steps
        assert row["margin"] > 0.3 and row["dpo_loss"] < 0.55, steps
    assert all(row["test/nll"] == row["test/nll"] for row in rows if "test/nll" in row)
    assert_checkpoints_on_server(log_path, chat_server, ["000003", "final"])


# `recipes.rl_loop` (the single-file loop) unmodified, on local stand-ins for what it gets
# from outside: gsm8k from the hub becomes a few sums; its model_info lookup (a hub name ->
# renderer) answers `role_colon`; its grader (`\boxed{}` checked against gsm8k's answer,
# always 0 for a random tiny model, which leaves every group's advantages zero and every step
# skipped) becomes "shorter is better"; and math_rl's graders, which it imports, get an empty
# `pylatexenc` where that is not installed (only its LaTeX parsing, never called here, uses it).
# rl_loop logs no sampler-vs-trainer KL, so the driver wraps forward_backward to record the
# cookbook's `kl_sample_train_v1` over the sampled tokens (where the sent logprobs are nonzero).
RL_LOOP_DRIVER = """
import importlib.util, json, sys, types
import datasets, tinker, torch

if importlib.util.find_spec("pylatexenc") is None:
    sys.modules["pylatexenc"] = types.ModuleType("pylatexenc")
    sys.modules["pylatexenc"].latex2text = types.ModuleType("pylatexenc.latex2text")
from tinker_cookbook import model_info
from tinker_cookbook.recipes import rl_loop

model, base_url, log_path, loss_fn, kl_path = sys.argv[1:]
rows = [
    {"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\\n#### {a + b}"}
    for a in range(1, 4) for b in range(1, 5)
]
datasets.load_dataset = lambda *args, **kwargs: datasets.DatasetDict(
    train=datasets.Dataset.from_list(rows)
)
model_info.get_recommended_renderer_name = lambda model_name: "role_colon"
rl_loop.get_reward = lambda response, answer: 1.0 / (1.0 + len(response))


class RecordsKL:
    def __init__(self, future, data):
        self.future, self.data = future, data

    def result(self, timeout=None):
        output = self.future.result(timeout)
        diffs = []
        for datum, out in zip(self.data, output.loss_fn_outputs, strict=True):
            sampled = datum.loss_fn_inputs["logprobs"].to_torch()
            diffs.append((sampled - out["logprobs"].to_torch())[sampled != 0])
        with open(kl_path, "a") as file:
            file.write(json.dumps(torch.cat(diffs).mean().item()) + "\\n")
        return output


forward_backward = tinker.TrainingClient.forward_backward
tinker.TrainingClient.forward_backward = lambda self, data, loss_fn, *args: RecordsKL(
    forward_backward(self, data, loss_fn, *args), data
)
rl_loop.main(rl_loop.Config(
    base_url=base_url, log_path=log_path, model_name=model, batch_size=4, group_size=4,
    learning_rate=1e-3, lora_rank=8, save_every=2, max_tokens=6, loss_fn=loss_fn, max_steps=3,
))
"""


@pytest.mark.parametrize("loss_fn", ["gspo", "stable_reinforce"])
def test_cookbook_rl_loop_recipe_runs_offline(chat_server, chat_model_dir, tmp_path, loss_fn):
    driver = tmp_path / "rl_loop.py"
    driver.write_text(RL_LOOP_DRIVER)
    log_path, kl_path = tmp_path / "rl_loop", tmp_path / "kl.jsonl"
    arguments = [str(chat_model_dir), chat_server.base_url, str(log_path), loss_fn, str(kl_path)]
    run_cookbook([str(driver), *arguments], server=chat_server, cwd=tmp_path)

    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert 0 < row["reward/total"] < 1  # 1 / (1 + response length), averaged
    # Every step trained (no group of equal rewards), on the server's sampled logprobs.
    kls = [json.loads(line) for line in kl_path.read_text().splitlines()]
    assert len(kls) == 3
    assert all(abs(kl) < 1e-3 for kl in kls), kls
    assert_checkpoints_on_server(log_path, chat_server, ["000002", "final"])
