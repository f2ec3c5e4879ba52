"""Serving on several ranks: rank 0's backend replays every training call on every rank.

On 2 gloo ranks, `ReplicatedService` trains like one process on the whole batch (per-datum
outputs back in the caller's order), a bad datum in rank 1's share or a model that cannot be
created fails on every rank without a hang and changes nothing, and dropped models are
released everywhere. Then `temper serve --nproc 2`, driven by the unmodified tinker SDK, gives
the numbers of a one-process server on the same requests, answers a bad request with a 4xx
and keeps serving, and all its processes exit with code 0 when it is terminated.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from temper import api
from temper.api import AdamParams, Datum, ModelInput
from temper.api.backend import ServiceBackend, TrainingBackend
from temper.client.service_client import ServiceClient
from temper.server.backends.replicated import ReplicatedService, follow, replay_ranks
from temper.trainer import TrainerEngine
from temper.trainer.sharding import Sharding
from tests.distributed.spawn import spawn

TEXTS = ("12=3", "45=9", "7=7", "123=6", "9=9")
ADAM = AdamParams(learning_rate=1e-2)


def _datum(tokens: list[int], *, module) -> object:
    weights = [0.0] * (len(tokens) - 3) + [1.0, 1.0]
    return module.Datum(
        model_input=module.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def _data(tokenizer, *, module) -> list:
    return [
        _datum([*tokenizer.encode(text), tokenizer.eos_token_id], module=module) for text in TEXTS
    ]


def _train(training, tokenizer, *, module) -> dict:
    """Three steps on five datums (split 3 + 2 over two ranks), then a sample and a forward.
    `module` holds the types: temper.api in process, tinker.types through the SDK."""
    data = _data(tokenizer, module=module)
    losses, logprobs, grad_norms = [], [], []
    for _ in range(3):
        output = training.forward_backward(data, "cross_entropy").result()
        losses.append(output.metrics["loss:sum"])
        logprobs.append([out["logprobs"].tolist() for out in output.loss_fn_outputs])
        grad_norms.append(training.optim_step(module.AdamParams(learning_rate=1e-2)).result())
    sampler = training.save_weights_and_get_sampling_client()
    if hasattr(sampler, "result"):  # the SDK's is a future; temper's backend's is synchronous
        sampler = sampler.result()
    prompt = module.ModelInput.from_ints(tokenizer.encode("12="))
    params = module.SamplingParams(max_tokens=4, temperature=1.0, seed=5)
    sample = sampler.sample(prompt, 2, params).result()
    forward = training.forward(data, "cross_entropy").result()
    return {
        "losses": losses,
        "logprobs": logprobs,
        "grad_norms": [step.metrics["grad_norm:mean"] for step in grad_norms],
        "tokens": [sequence.tokens for sequence in sample.sequences],
        "sample_logprobs": [sequence.logprobs for sequence in sample.sequences],
        "forward": forward.metrics["loss:sum"],
    }


def _backend_on_ranks(rank: int, storage: Path) -> dict:
    sharded = TrainerEngine.Config(sharding=Sharding.Config())
    service = ServiceClient(storage_dir=storage / "ranks", trainer=sharded)
    ranks = replay_ranks()
    if rank > 0:
        follow(service, ranks=ranks)
        return {}
    backend = ReplicatedService(service, ranks=ranks)
    training = backend.create_lora_training_client("tiny", rank=4, seed=1, run_id="replayed")
    tokenizer = training.get_tokenizer()
    result = {"replayed": _train(training, tokenizer, module=api)}
    result["protocols"] = isinstance(backend, ServiceBackend) and isinstance(
        training, TrainingBackend
    )
    data = _data(tokenizer, module=api)
    before = training.forward(data, "cross_entropy").result().metrics
    bad = [*data[:-1], Datum(model_input=ModelInput.from_ints([1, 999]), loss_fn_inputs={})]
    with pytest.raises(ValueError) as bad_datum:
        training.forward_backward(bad, "cross_entropy").result()
    result["bad_datum"] = str(bad_datum.value)
    with pytest.raises(ValueError) as bad_create:
        backend.create_lora_training_client("tiny", rank=0, run_id="never")
    result["bad_create"] = str(bad_create.value)
    result["unchanged"] = training.forward(data, "cross_entropy").result().metrics == before
    result["grad_norm_after_errors"] = training.optim_step(ADAM).result().metrics["grad_norm:mean"]
    del training
    gc.collect()  # the handle is gone: the model is released on every rank
    backend.create_training_client("tiny", run_id="second")
    result["models_left"] = sorted(backend.replica.clients)
    backend.stop()

    reference = ServiceClient(storage_dir=storage / "one")
    local = reference.create_lora_training_client("tiny", rank=4, seed=1)
    result["one_process"] = _train(local, local.get_tokenizer(), module=api)
    return result


def _assert_close(replayed: dict, reference: dict) -> None:
    for key in ("losses", "grad_norms", "forward"):
        assert replayed[key] == pytest.approx(reference[key], rel=1e-4), key
    pairs = zip(replayed["logprobs"], reference["logprobs"], strict=True)
    for step, (ours, theirs) in enumerate(pairs):
        assert len(ours) == len(theirs) == len(TEXTS)
        for datum_ours, datum_theirs in zip(ours, theirs, strict=True):
            assert datum_ours == pytest.approx(datum_theirs, rel=1e-4, abs=1e-5), step
    assert replayed["tokens"] == reference["tokens"]
    for ours, theirs in zip(replayed["sample_logprobs"], reference["sample_logprobs"], strict=True):
        assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-5)


def test_replicated_backend_on_two_ranks_trains_like_one_process(tmp_path):
    result, _ = spawn(_backend_on_ranks, world_size=2, out_dir=tmp_path, args=(tmp_path,))
    assert result["protocols"]  # the server's backend seam
    _assert_close(result["replayed"], result["one_process"])
    assert result["bad_datum"].startswith("rank 1 rejected the request:")
    assert "999" in result["bad_datum"]
    assert "LoraConfig.rank must be an int >= 1" in result["bad_create"]
    assert result["unchanged"]
    assert result["grad_norm_after_errors"] == 0.0  # the failed call left no gradient behind
    assert result["models_left"] == ["second"]


# -- temper serve --nproc 2 through the tinker SDK ---------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from temper.checkpoint.model_source import init_model_dir

    directory = tmp_path_factory.mktemp("models") / "tiny-digits"
    init_model_dir(directory, size="tiny", tokenizer="digits", seed=0)
    return directory


def _sdk_session(server, model_dir: Path) -> dict:
    import tinker
    from tinker import types

    service = server.service()
    training = service.create_lora_training_client(str(model_dir), rank=8, seed=3).result()
    tokenizer = training.get_tokenizer()
    result = _train(training, tokenizer, module=types)
    short = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]},
    )
    with pytest.raises(tinker.BadRequestError, match="shape"):
        training.forward_backward([short], "cross_entropy").result()
    data = _data(tokenizer, module=types)
    path = training.save_state("trained").result().path
    result["saved"] = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    restored = service.create_training_client_from_state_with_optimizer(path).result()
    result["restored"] = restored.forward(data, "cross_entropy").result().metrics["loss:sum"]
    service.close("success").result()
    return result


def test_serve_nproc_2_through_the_sdk_matches_one_process(model_dir, tmp_path):
    pytest.importorskip("tinker")
    pytest.importorskip("uvicorn")
    from tests.server.conftest import start_server

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["TINKER_TELEMETRY"] = "0"
    ranks_log = tmp_path / "ranks.log"
    ranks = start_server(model_dir, tmp_path / "ranks", ranks_log, "--nproc", "2")
    try:
        replayed = _sdk_session(ranks, model_dir)
    finally:
        ranks.stop()
    log = ranks_log.read_text()
    assert ranks.process.returncode == 0, log
    assert "Traceback" not in log and "2 ranks" in log

    single = start_server(model_dir, tmp_path / "one", tmp_path / "one.log")
    try:
        reference = _sdk_session(single, model_dir)
    finally:
        single.stop()
    _assert_close(replayed, reference)
    assert replayed["restored"] == pytest.approx(replayed["saved"], rel=1e-6)
    assert replayed["saved"] == pytest.approx(reference["saved"], rel=1e-4)


def test_serve_nproc_refuses_bad_values_and_a_missing_model_before_starting(
    model_dir, tmp_path, capsys
):
    from temper.cli import main

    for value in ("0", "two"):
        assert main(["serve", "--model", str(tmp_path), "--nproc", value]) == 2
        assert f"--nproc {value}" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path / "missing"), "--nproc", "2"]) == 2
    assert "missing" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path), "--nproc", "2", "--host", "0.0.0.0"]) == 2
    assert "requires --key-file FILE" in capsys.readouterr().err
    from tests.server.conftest import free_port

    vllm = ["--generator.backend", "vllm", "--port", str(free_port())]
    assert main(["serve", "--model", str(model_dir), "--nproc", "2", *vllm]) == 2
    assert "--generator.backend vllm runs in one process" in capsys.readouterr().err
