"""LoRA training clients of one ServiceClient share one frozen base (client/shared_base.py).

Each client trains bitwise as it would alone on a private base, whatever the others do in
between, and nothing any of them does writes the shared tensors.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from temper import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from temper.trainer.engine import TrainerEngine

ADAM = AdamParams(learning_rate=1e-2)
CLIENTS = [dict(rank=2, seed=1), dict(rank=4, seed=7), dict(rank=8, seed=3)]
VERBS = (
    ["forward_backward", "sample", "optim_step", "save_load"]
    + [
        "forward_backward",
        "optim_step",
    ]
    * 2
    + ["sample"]
)


def _data(tokenizer, offset):
    data = []
    for index in range(3):
        prompt = tokenizer.encode(f"{index + offset}{index + 1}=")
        answer = [*tokenizer.encode(str(2 * index + offset)), tokenizer.eos_token_id]
        tokens = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        data.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
    return data


def _sample(client):
    sampler = client.save_weights_and_get_sampling_client()
    prompt = ModelInput.from_ints(client.get_tokenizer().encode("12="))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    response = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    return [(s.tokens, s.logprobs) for s in response.sequences]


def _step(client, index, verb, log):
    """One verb on `client`; what it returns goes into `log` (compared bitwise)."""
    data = _data(client.get_tokenizer(), offset=index)
    if verb == "forward_backward":
        out = client.forward_backward(data, "cross_entropy").result()
        log.append((out.metrics, [o["logprobs"].data for o in out.loss_fn_outputs]))
    elif verb == "optim_step":
        log.append(client.optim_step(ADAM).result().metrics)
    elif verb == "save_load":
        path = client.save_state(f"s{len(log)}").result().path
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(ADAM).result()
        client.load_state_with_optimizer(path).result()  # back to the saved state
        log.append(path.rsplit("/", 1)[1])
    elif verb == "sample":
        log.append(_sample(client))


def interleaved(clients, verbs, *, seed):
    """Every client runs `verbs`, the clients interleaved in a random order (each client's
    own order fixed); returns each client's log."""
    rng = random.Random(seed)
    queues = [list(verbs) for _ in clients]
    logs = [[] for _ in clients]
    while any(queues):
        who = rng.choice([w for w, queue in enumerate(queues) if queue])
        _step(clients[who], who, queues[who].pop(0), logs[who])
    return logs


def _weights(client):
    return {k: v.detach().clone() for k, v in client.engine.model.state_dict().items()}


@pytest.mark.parametrize("shard_threads", [1, 2])
def test_shared_base_trains_bitwise_like_a_private_base(tmp_path, shard_threads):
    trainer = TrainerEngine.Config(shard_threads=shard_threads)
    shared = ServiceClient(storage_dir=tmp_path / "shared", trainer=trainer)
    clients = [shared.create_lora_training_client("tiny", **kw) for kw in CLIENTS]
    base = clients[0].shared_base
    assert base is not None and all(c.shared_base is base for c in clients)
    fingerprint = base.fingerprint()
    logs = interleaved(clients, VERBS, seed=0)
    base.check_unchanged(fingerprint)

    for who, kw in enumerate(CLIENTS):
        alone = ServiceClient(storage_dir=tmp_path / f"alone{who}", trainer=trainer)
        client = alone.create_lora_training_client("tiny", **kw)
        assert client.shared_base is not base
        log = []
        for verb in VERBS:
            _step(client, who, verb, log)
        assert log == logs[who], f"client {who}"
        ours, theirs = _weights(clients[who]), _weights(client)
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), (who, key)


def test_lora_clients_share_one_storage_and_full_clients_do_not(tmp_path):
    service = ServiceClient(storage_dir=tmp_path / "storage")
    first = service.create_lora_training_client("tiny", rank=2)
    second = service.create_lora_training_client("tiny", rank=4, train_unembed=False)
    full = service.create_training_client("tiny")
    key = "blocks.0.attention.wq.weight"
    pointers = [c.engine.model.state_dict()[key].data_ptr() for c in (first, second, full)]
    assert pointers[0] == pointers[1] != pointers[2]
    assert full.shared_base is None
    # Each client's parameters are its own objects (frozen), on the shared storage.
    one, two = first.engine.model, second.engine.model
    assert one.get_parameter(key) is not two.get_parameter(key)
    assert not one.get_parameter(key).requires_grad
    assert [p.requires_grad for p in first.engine.trainable] and all(
        "lora" in name for name, p in one.named_parameters() if p.requires_grad
    )


def test_full_fine_tuning_next_to_lora_leaves_the_shared_base_alone(tmp_path):
    service = ServiceClient(storage_dir=tmp_path / "storage")
    lora = service.create_lora_training_client("tiny", rank=4)
    fingerprint = lora.shared_base.fingerprint()
    full = service.create_training_client("tiny")
    for _ in range(2):
        full.forward_backward(_data(full.get_tokenizer(), 0), "cross_entropy")
        full.optim_step(ADAM).result()
    _sample(full)
    lora.load_state(lora.save_state("zero").result().path).result()
    service.create_training_client_from_state(lora.save_state("again").result().path)
    lora.shared_base.check_unchanged(fingerprint)


def test_the_base_is_freed_with_its_last_client(tmp_path):
    service = ServiceClient(storage_dir=tmp_path / "storage")
    clients = [service.create_lora_training_client("tiny", rank=2) for _ in range(2)]
    assert len(service.shared_bases) == 1
    del clients
    gc.collect()
    assert len(service.shared_bases) == 0


def test_the_guard_sees_a_write_through_any_client(tmp_path):
    service = ServiceClient(storage_dir=tmp_path / "storage")
    client = service.create_lora_training_client("tiny", rank=2)
    fingerprint = client.shared_base.fingerprint()
    parameter = client.engine.model.get_parameter("blocks.0.feed_forward.w_up.weight")
    with torch.no_grad():
        parameter.mul_(1.0)  # same values, but written
    with pytest.raises(AssertionError, match="was replaced or written"):
        client.shared_base.check_unchanged(fingerprint)


def _submit_all(client, who):
    """A few steps' futures, submitted without waiting (the client's worker runs them)."""
    data = _data(client.get_tokenizer(), offset=who)
    futures = []
    for _ in range(3):
        futures.append(client.forward_backward(data, "cross_entropy"))
        futures.append(client.optim_step(ADAM))
    futures.append(client.forward(data, "cross_entropy"))
    return futures


def _outcome(futures):
    results = [future.result() for future in futures]
    return [
        (r.metrics, [o["logprobs"].data for o in getattr(r, "loss_fn_outputs", [])])
        for r in results
    ]


def test_concurrent_clients_on_one_base_match_each_alone(tmp_path):
    configs = [dict(rank=2, seed=1), dict(rank=4, seed=2), dict(rank=8, seed=3), dict(rank=2)]
    shared = ServiceClient(storage_dir=tmp_path / "shared")
    clients = [shared.create_lora_training_client("tiny", **kw) for kw in configs]
    fingerprint = clients[0].shared_base.fingerprint()
    # Every client's worker thread runs at once, on the same base tensors.
    pending = [_submit_all(client, who) for who, client in enumerate(clients)]
    outcomes = [_outcome(futures) for futures in pending]
    clients[0].shared_base.check_unchanged(fingerprint)
    for who, kw in enumerate(configs):
        alone = ServiceClient(storage_dir=tmp_path / f"alone{who}")
        client = alone.create_lora_training_client("tiny", **kw)
        assert _outcome(_submit_all(client, who)) == outcomes[who], f"client {who}"


def test_a_bfloat16_shared_base_is_left_alone_by_merges_and_samples(tmp_path):
    service = ServiceClient(storage_dir=tmp_path / "storage", dtype="bfloat16")
    clients = [service.create_lora_training_client("tiny", rank=4, seed=s) for s in (1, 2)]
    fingerprint = clients[0].shared_base.fingerprint()
    for who, client in enumerate(clients):
        client.forward_backward(_data(client.get_tokenizer(), who), "cross_entropy")
        client.optim_step(ADAM).result()
        _sample(client)
        client.save_weights_for_sampler(f"w{who}").result()
    clients[0].shared_base.check_unchanged(fingerprint)
    assert next(clients[1].engine.model.parameters()).dtype == torch.bfloat16
