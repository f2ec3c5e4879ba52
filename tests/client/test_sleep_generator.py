"""`sleep_generator`: a training client's generator lets its KV cache go while the trainer runs
forward_backward and takes it back to sample, with the same samples as one that never slept."""

from __future__ import annotations

from temper.api import AdamParams, Datum, ModelInput, SamplingParams
from temper.client.service_client import ServiceClient
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine

TOKENS = [1, 2, 3, 4, 5, 6]


def _run(tmp_path, *, sleep: bool) -> dict:
    service = ServiceClient(
        storage_dir=tmp_path / f"sleep-{sleep}",
        sampler=SamplerEngine.Config(
            max_batch=8, max_seq_len=32, cpu=CpuDecoding.Config(processes=1)
        ),
        sleep_generator=sleep,
    )
    client = service.create_training_client("tiny")
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    prompt = ModelInput.from_ints(TOKENS[:3])
    sampler = client.save_weights_and_get_sampling_client()
    first = sampler.sample(prompt, num_samples=4, sampling_params=params).result()
    cache = {"before": sampler.generator.cache.nbytes}
    datum = Datum(
        model_input=ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )
    client.forward_backward([datum], "cross_entropy").result()
    cache["training"] = sampler.generator.cache.nbytes
    client.optim_step(AdamParams(learning_rate=1e-2)).result()
    sampler = client.save_weights_and_get_sampling_client()
    second = sampler.sample(prompt, num_samples=4, sampling_params=params).result()
    cache["after"] = sampler.generator.cache.nbytes
    samples = [[(s.tokens, s.logprobs) for s in response.sequences] for response in (first, second)]
    return {"cache": cache, "samples": samples}


def test_the_generator_sleeps_while_the_trainer_steps_and_samples_the_same(tmp_path):
    awake, sleeping = _run(tmp_path, sleep=False), _run(tmp_path, sleep=True)
    assert awake["cache"]["training"] == awake["cache"]["before"] > 0
    assert sleeping["cache"]["training"] == 0  # released during forward_backward
    assert sleeping["cache"]["after"] == sleeping["cache"]["before"]  # back to sample
    assert sleeping["samples"] == awake["samples"]
