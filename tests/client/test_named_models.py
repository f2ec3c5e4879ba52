"""Named base models of every family: HF repo ids, FAMILY/SIZE and Qwen3 sizes alone (the
spellings that were accepted before), through the clients and the job's model choice; a
directory of the same name wins; a bad name lists the valid ones."""

from __future__ import annotations

import dataclasses

import pytest

from temper.checkpoint.model_source import init_model_dir
from temper.client.named_models import HF_REPO_IDS, named_model
from temper.client.sampler_weights import resolve_base_model
from temper.client.service_client import ServiceClient
from temper.job import ModelChoice
from temper.models import LLAMA_SIZES, QWEN3_MOE_SIZES, QWEN3_SIZES, Llama, Qwen3, Qwen3Moe
from temper.models.registry import MODEL_FAMILIES
from temper.sampler.engine import SamplerEngine
from temper.tokenizer import build_builtin_tokenizer
from temper.trainer.engine import TrainerEngine


def test_every_published_size_of_every_family_has_an_hf_repo_id():
    published = {(name, size) for name, f in MODEL_FAMILIES.items() for size in f.sizes}
    published -= {(name, "tiny") for name in MODEL_FAMILIES}
    assert set(HF_REPO_IDS.values()) == published


@pytest.mark.parametrize(
    ("name", "same_as"),
    [
        ("Qwen/Qwen3.6-35B-A3B", "Qwen/Qwen3.5-35B-A3B"),  # tinker-cookbook's defaults
        ("Qwen/Qwen3.5-9B-Base", "Qwen/Qwen3.5-9B"),
    ],
)
def test_checkpoints_that_share_a_sizes_shapes_name_it(name, same_as):
    assert named_model(name, what="model").config() == named_model(same_as, what="model").config()


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("Qwen/Qwen3-8B", QWEN3_SIZES["8B"]),
        ("8B", QWEN3_SIZES["8B"]),  # a Qwen3 size alone, as before
        ("qwen3/8B", QWEN3_SIZES["8B"]),
        ("meta-llama/Llama-3.1-8B", LLAMA_SIZES["8B"]),
        ("llama/8B", LLAMA_SIZES["8B"]),
        ("meta-llama/Llama-3.2-1B", LLAMA_SIZES["1B"]),
        ("Qwen/Qwen3-30B-A3B", QWEN3_MOE_SIZES["30B-A3B"]),
        ("qwen3_moe/235B-A22B", QWEN3_MOE_SIZES["235B-A22B"]),
        ("qwen3_moe/tiny", QWEN3_MOE_SIZES["tiny"]),
    ],
)
def test_names_pick_their_familys_published_shapes(name, config):
    assert named_model(name, what="model").config() == config


def test_qwen3_and_llama_8b_are_different_models():
    qwen3, llama = (named_model(name, what="model") for name in ("8B", "llama/8B"))
    assert (qwen3.family, llama.family) == ("qwen3", "llama")
    assert qwen3.config() != llama.config()


def test_a_tokenizer_after_the_name_sets_the_vocabulary():
    letters = build_builtin_tokenizer("letters").vocab_size
    named = named_model("Qwen/Qwen3-30B-A3B:letters", what="model")
    assert named.config() == dataclasses.replace(QWEN3_MOE_SIZES["30B-A3B"], vocab_size=letters)
    source = named.source(device="cpu", dtype="float32")
    assert (source.family, source.size, source.tokenizer) == ("qwen3_moe", "30B-A3B", "letters")
    # The clients pair a name without a tokenizer with digits, as before.
    plain = resolve_base_model("meta-llama/Llama-3.1-70B", device="cpu", dtype="bfloat16")
    assert (plain.family, plain.size, plain.tokenizer, plain.dtype) == (
        "llama",
        "70B",
        "digits",
        "bfloat16",
    )


@pytest.mark.parametrize("name", ["3B", "llama/32B", "Qwen/Qwen3-3B", "qwen4/tiny", "mistral"])
def test_an_unknown_name_lists_the_valid_ones(name):
    with pytest.raises(ValueError) as error:
        resolve_base_model(name, device="cpu", dtype="float32")
    message = str(error.value)
    assert message.startswith(f"base_model {name!r} is neither a model directory nor a named size")
    for valid in ("Qwen/Qwen3-8B", "meta-llama/Llama-3.2-3B", "Qwen/Qwen3-30B-A3B"):
        assert valid in message
    assert "llama: tiny, 1B, 3B, 8B, 70B" in message and "qwen3_moe: tiny, 30B-A3B" in message


def test_an_unknown_tokenizer_is_named():
    with pytest.raises(ValueError, match=r"unknown built-in tokenizer 'klingon' after ':'"):
        named_model("llama/tiny:klingon", what="base_model")


def test_a_directory_of_the_same_name_wins(tmp_path, monkeypatch):
    init_model_dir(tmp_path / "Qwen" / "Qwen3-8B", tokenizer="letters")
    monkeypatch.chdir(tmp_path)
    source = resolve_base_model("Qwen/Qwen3-8B", device="cpu", dtype="float32")
    assert source.path == "Qwen/Qwen3-8B"


@pytest.mark.parametrize(
    ("name", "cls", "vocab"),
    [
        ("llama/tiny", Llama, "digits"),
        ("qwen3_moe/tiny:letters", Qwen3Moe, "letters"),
        ("tiny:words", Qwen3, "words"),
    ],
)
def test_clients_build_random_models_of_each_family(tmp_path, name, cls, vocab):
    service = ServiceClient(storage_dir=tmp_path)
    model = service.create_training_client(name).engine.model
    family = next(key for key, f in MODEL_FAMILIES.items() if f.model_cls is cls)
    vocab_size = build_builtin_tokenizer(vocab).vocab_size
    assert type(model) is cls
    assert model.config == dataclasses.replace(
        MODEL_FAMILIES[family].sizes["tiny"], vocab_size=vocab_size
    )
    sampler = service.create_sampling_client(base_model=name)
    assert sampler.get_tokenizer().vocab_size == vocab_size


def test_a_job_trains_a_named_model_of_another_family(tmp_path):
    choice = ModelChoice.Config(base_model="llama/tiny:letters", device="cpu").build()
    service = choice.service_client(
        storage_dir=tmp_path,
        sampler=SamplerEngine.Config(max_batch=2, max_seq_len=32),
        trainer=TrainerEngine.Config(),
    )
    training = choice.training_client(service, train_state=None, job_seed=0)
    assert isinstance(training.engine.model, Llama)
    bad = ModelChoice.Config(base_model="llama/3.1B", device="cpu").build()
    with pytest.raises(ValueError, match=r"^--model.base_model: base_model 'llama/3.1B' is nei"):
        bad.training_client(service, train_state=None, job_seed=0)
