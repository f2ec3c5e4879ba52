"""The in-process Tinker-style API end to end: ServiceClient, TrainingClient, SamplingClient."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from temper import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from temper.client.sampler_weights import sampler_vocab_size
from temper.models.common.logprobs import forward_logprobs

ADAM = AdamParams(learning_rate=1e-2)


@pytest.fixture
def service(tmp_path):
    return ServiceClient(storage_dir=tmp_path / "storage")


def _data(tokenizer, count=4):
    data = []
    for index in range(count):
        prompt = tokenizer.encode(f"{index}{index + 1}=")
        answer = [*tokenizer.encode(str(2 * index + 1)), tokenizer.eos_token_id]
        tokens = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        data.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
    return data


def _train(client, data, steps):
    for _ in range(steps):
        client.forward_backward(data, "cross_entropy")
        step = client.optim_step(ADAM)
    return step.result()  # futures resolve in submission order


def _params(client):
    return [p.detach().clone() for p in client.engine.trainable]


def test_requests_run_in_submission_order(service):
    client = service.create_training_client("tiny")
    data = _data(client.get_tokenizer())
    futures = [client.forward_backward(data, "cross_entropy") for _ in range(3)]
    step = client.optim_step(ADAM)
    after = client.forward(data, "cross_entropy")
    losses = [f.result().metrics["loss:sum"] for f in futures]
    assert losses[0] == losses[1] == losses[2]  # no step in between
    assert step.result().metrics["policy_version:max"] == 1
    assert after.result().metrics["loss:sum"] < losses[0]


def test_async_variants(service):
    client = service.create_lora_training_client("tiny", rank=4)
    data = _data(client.get_tokenizer())

    async def run():
        future = await client.forward_backward_async(data, "cross_entropy")
        step = await client.optim_step_async(ADAM)
        return (await future).metrics["loss:sum"], (await step.result_async()).metrics

    loss, metrics = asyncio.run(run())
    assert loss > 0 and metrics["policy_version:max"] == 1


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_save_load_and_continue_is_bitwise_equal_to_uninterrupted(service, lora):
    def make():
        if lora:
            return service.create_lora_training_client("tiny", rank=4, seed=3)
        return service.create_training_client("tiny")

    straight = make()
    data = _data(straight.get_tokenizer())
    _train(straight, data, 4)
    interrupted = make()
    _train(interrupted, data, 2)
    path = interrupted.save_state("step2").result().path
    assert path == f"tinker://{interrupted.model_id}/weights/step2"
    _train(interrupted, data, 1)  # diverge, then go back
    interrupted.load_state_with_optimizer(path).result()
    _train(interrupted, data, 2)
    resumed = service.create_training_client_from_state_with_optimizer(path)
    _train(resumed, data, 2)
    for a, b, c in zip(_params(straight), _params(interrupted), _params(resumed), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert interrupted.engine.policy_version == straight.engine.policy_version


def test_load_state_without_optimizer_resets_moments(service):
    client = service.create_training_client("tiny")
    data = _data(client.get_tokenizer())
    _train(client, data, 2)
    path = client.save_state("w").result().path
    fresh = service.create_training_client_from_state(path)
    assert all(torch.equal(a, b) for a, b in zip(_params(client), _params(fresh), strict=True))
    assert not fresh.engine.optimizer.torch_optimizer.state


def test_full_fine_tuning_sampler_shares_weights_until_they_change(service):
    client = service.create_training_client("tiny")
    data = _data(client.get_tokenizer())
    _train(client, data, 3)
    sampler = client.save_weights_and_get_sampling_client()
    assert sampler.generator.model is client.engine.model  # no copy
    prompt = ModelInput.from_ints(data[0].model_input.to_ints()[:3])
    params = SamplingParams(max_tokens=3, temperature=0)
    before = sampler.sample(prompt, 2, params).result().sequences
    _train(client, data, 1)  # the live client keeps its version (copy-on-write)
    assert sampler.sample(prompt, 2, params).result().sequences == before
    assert sampler.version == 3 and client.num_sampler_snapshots == 1
    fresh = client.save_weights_and_get_sampling_client()
    assert fresh.version == client.engine.policy_version == 4
    assert fresh.generator.model is client.engine.model
    assert not (service.storage.root / client.model_id / "sampler_weights").exists()


def test_lora_sampler_serves_merged_weights_from_memory(service):
    client = service.create_lora_training_client("tiny", rank=4)
    tokenizer = client.get_tokenizer()
    data = _data(tokenizer)
    _train(client, data, 20)
    sampler = client.save_weights_and_get_sampling_client()
    assert not (service.storage.root / client.model_id / "sampler_weights").exists()
    tokens = [*data[1].model_input.to_ints(), data[1].loss_fn_inputs["target_tokens"].tolist()[-1]]
    with torch.no_grad():
        expected = forward_logprobs(
            client.engine.model, torch.tensor([tokens[:-1]]), torch.tensor([tokens[1:]])
        )[0]
    got = sampler.compute_logprobs(ModelInput.from_ints(tokens)).result()
    assert got[0] is None
    torch.testing.assert_close(torch.tensor(got[1:]), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_saved_sampler_weights_load_in_a_new_sampling_client(service, lora):
    if lora:
        client = service.create_lora_training_client("tiny", rank=4)
    else:
        client = service.create_training_client("tiny")
    data = _data(client.get_tokenizer())
    _train(client, data, 10)
    path = client.save_weights_for_sampler("final").result().path
    assert path.endswith("/sampler_weights/final")
    in_memory = client.save_weights_and_get_sampling_client()
    from_disk = service.create_sampling_client(model_path=path)
    prompt = ModelInput.from_ints(data[2].model_input.to_ints()[:4])
    params = SamplingParams(max_tokens=4, temperature=0)
    a = in_memory.sample(prompt, 1, params).result().sequences[0]
    b = from_disk.sample(prompt, 1, params).result().sequences[0]
    assert a.tokens == b.tokens
    torch.testing.assert_close(
        torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
    )
    assert from_disk.get_tokenizer().encode("12=") == client.get_tokenizer().encode("12=")
    # What a KL reference on generator ranks is told of it, read without its weights (a LoRA
    # checkpoint has no config.json).
    _, directory = service.storage.existing(path)
    assert sampler_vocab_size(directory) == client.engine.model.config.vocab_size


def test_info_and_base_models(service, tmp_path):
    from temper.checkpoint.model_source import init_model_dir

    client = service.create_lora_training_client("tiny:letters", rank=8)
    info = client.get_info()
    assert info.model_data.model_name == "tiny:letters" and info.is_lora and info.lora_rank == 8
    assert client.get_tokenizer().vocab_size == 99
    init_model_dir(tmp_path / "m", tokenizer="words")
    from_dir = service.create_training_client(str(tmp_path / "m"))
    assert from_dir.get_tokenizer().vocab_size == from_dir.engine.model.config.vocab_size
    sampler = service.create_sampling_client(base_model="tiny")
    assert sampler.sample(ModelInput.from_ints([1, 2]), 1, SamplingParams(max_tokens=2)).result()


def test_lora_weights_of_a_relative_base_dir_load_from_another_directory(tmp_path, monkeypatch):
    from temper.checkpoint.model_source import init_model_dir

    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    init_model_dir("m", tokenizer="digits")
    service = ServiceClient(storage_dir="storage")
    client = service.create_lora_training_client("m", rank=4)  # relative, as a CLI user types
    _train(client, _data(client.get_tokenizer()), 2)
    path = client.save_weights_for_sampler("final").result().path
    state = client.save_state("state").result().path
    monkeypatch.chdir(tmp_path)
    elsewhere = ServiceClient(storage_dir="work/storage")
    prompt, params = ModelInput.from_ints([1, 2]), SamplingParams(max_tokens=2, temperature=0)
    assert elsewhere.create_sampling_client(model_path=path).sample(prompt, 1, params).result()
    assert elsewhere.create_training_client_from_state(state).get_info().is_lora


def test_a_lora_checkpoint_loads_into_a_client_seeded_otherwise(service):
    # The seed only draws the adapters' first values, which loading replaces.
    trained = service.create_lora_training_client("tiny", rank=4, seed=0)
    _train(trained, _data(trained.get_tokenizer()), steps=2)
    path = trained.save_state("s").result().path
    other = service.create_lora_training_client("tiny", rank=4, seed=1)
    other.load_state(path).result()
    assert all(torch.equal(a, b) for a, b in zip(_params(trained), _params(other), strict=True))
    wider = service.create_lora_training_client("tiny", rank=8, seed=0)
    with pytest.raises(ValueError, match=r"\(rank 4 saved, 8 here\)$"):
        wider.load_state(path).result()


def test_bad_names_and_paths_are_refused(service):
    client = service.create_training_client("tiny")
    with pytest.raises(ValueError, match="neither a model directory nor a named size"):
        service.create_training_client("no-such-model")
    with pytest.raises(ValueError, match="not a valid name"):
        client.save_state("../escape")
    with pytest.raises(ValueError, match="must look like tinker://"):
        client.load_state("/etc/passwd")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        client.load_state(f"tinker://{client.model_id}/weights/missing")
    client.save_state("once").result()
    with pytest.raises(FileExistsError):
        client.save_state("once").result()
    with pytest.raises(ValueError, match="exactly one of model_path, base_model"):
        service.create_sampling_client()


def test_concurrent_samples_decode_in_one_batch_but_never_cross_a_step(service, monkeypatch):
    client = service.create_training_client("tiny")
    sampler = client.save_weights_and_get_sampling_client()
    calls = []
    original = sampler.generator.generate
    monkeypatch.setattr(
        sampler.generator,
        "generate",
        lambda requests: (calls.append(len(requests)), original(requests))[1],
    )
    release = threading.Event()
    blocker = sampler._worker.submit(release.wait)  # keeps the sampler busy while we submit
    params = SamplingParams(max_tokens=2, temperature=0)
    prompts = [ModelInput.from_ints([1 + i, 2]) for i in range(5)]
    futures = [sampler.sample(p, 2, params) for p in prompts]
    release.set()
    blocker.result()
    assert [len(f.result().sequences) for f in futures] == [2] * 5
    assert calls == [5]
    bad = sampler.sample(ModelInput.from_ints([10_000]), 1, params)
    good = sampler.sample(prompts[0], 1, params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bad.result()
    assert good.result().sequences[0].tokens


def test_concurrent_logprobs_share_a_call_and_equal_lone_ones(service):
    client = service.create_training_client("tiny")
    sampler = client.save_weights_and_get_sampling_client()
    prompts = [ModelInput.from_ints([1 + i, 2, 3 + 2 * i, 4][: 2 + i % 3]) for i in range(5)]
    alone = [sampler.compute_logprobs(prompt).result() for prompt in prompts]
    with sampler.batch():  # one batch, whatever the timing
        futures = [sampler.compute_logprobs(prompt) for prompt in prompts]
        bad = sampler.compute_logprobs(ModelInput.from_ints([1, 10_000]))
    assert [future.result() for future in futures] == alone  # bitwise: each scored alone
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bad.result()  # and the others did not fail with it


def test_logprobs_of_a_batch_are_one_engine_score_and_close_to_lone_ones(service):
    client = service.create_training_client("tiny")
    sampler = client.save_weights_and_get_sampling_client()
    prompts = [ModelInput.from_ints([1 + i, 2, 3 + 2 * i, 4, 5][: 2 + i % 4]) for i in range(6)]
    prompts.append(ModelInput.from_ints([7]))  # one token: nothing to score
    together = sampler.compute_logprobs_batch(prompts).result()
    assert together == sampler.compute_logprobs_batch(prompts).result()  # the same every time
    sequences = [prompt.to_ints() for prompt in prompts[:-1]]
    scores = sampler.generator.score(sequences)  # the engine's batched forward, bitwise
    assert together == [*([None, *score.tolist()] for score in scores), [None]]
    for prompt, logprobs in zip(prompts, together, strict=True):
        alone = sampler.compute_logprobs(prompt).result()
        assert logprobs[0] is None and alone[0] is None
        assert logprobs[1:] == pytest.approx(alone[1:], abs=1e-5)
    assert sampler.compute_logprobs_batch([]).result() == []
    with pytest.raises(ValueError, match=r"prompts\[1\] token 10000 at position 1 is outside"):
        sampler.compute_logprobs_batch([prompts[0], ModelInput.from_ints([1, 10_000])])
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        sampler.compute_logprobs_batch([ModelInput.from_ints([])])
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a ModelInput, got list"):
        sampler.compute_logprobs_batch([[1, 2]])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"device='cuda'.*no CUDA device"):
        ServiceClient(storage_dir=tmp_path, device="cuda")
