"""Two sessions' LoRA models on one `temper serve` share the base weights, with no cross-talk.

Their verbs interleave; afterwards twins of each (same rank and seed) run the same verbs
alone, one at a time, and see bitwise the same losses, logprobs, optimizer metrics and
seeded samples. The budget counts the shared base once (client/shared_base.py,
server/state/server.py).
"""

from __future__ import annotations

import random

import pytest
from tinker import types

from temper.server.state.base_models import load_base_model
from temper.server.state.server import ServedModel, Session, TemperServer
from temper.trainer.engine import TrainerEngine
from temper.trainer.sharding import Sharding
from tests.server.conftest import start_server
from tests.server.test_sdk import datum

ADAM = types.AdamParams(learning_rate=1e-2)
CONFIGS = [dict(rank=4, seed=1), dict(rank=8, seed=2)]
VERBS = ["forward_backward", "optim_step", "sample", "save_load", "forward_backward"]
VERBS += ["optim_step", "forward", "sample"]


def step(model, who: int, verb: str, log: list) -> None:
    tokenizer = model.get_tokenizer()
    data = [datum(tokenizer, f"{who}{who + 1}=3"), datum(tokenizer, f"{who + 4}5=9")]
    if verb in ("forward_backward", "forward"):
        out = getattr(model, verb)(data, "cross_entropy").result()
        log.append((out.metrics, [o["logprobs"].tolist() for o in out.loss_fn_outputs]))
    elif verb == "optim_step":
        log.append(model.optim_step(ADAM).result().metrics)
    elif verb == "save_load":
        path = model.save_state(f"at{len(log)}").result().path
        model.forward_backward(data, "cross_entropy").result()
        model.optim_step(ADAM).result()
        model.load_state_with_optimizer(path).result()
        log.append("loaded")
    elif verb == "sample":
        sampler = model.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(tokenizer.encode("12="))
        params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=5)
        response = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
        log.append([(s.tokens, s.logprobs) for s in response.sequences])


@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state:FutureWarning")
def test_two_sessions_lora_models_train_as_if_alone(model_dir, tmp_path):
    server = start_server(model_dir, tmp_path / "storage", tmp_path / "server.log")
    try:
        sessions = [server.service() for _ in CONFIGS]
        models = [
            service.create_lora_training_client(str(model_dir), **config).result()
            for service, config in zip(sessions, CONFIGS, strict=True)
        ]
        rng = random.Random(0)
        queues = [list(VERBS) for _ in CONFIGS]
        logs = [[] for _ in CONFIGS]
        while any(queues):
            who = rng.choice([w for w, queue in enumerate(queues) if queue])
            step(models[who], who, queues[who].pop(0), logs[who])
        for service in sessions:
            service.close("success").result()

        for who, config in enumerate(CONFIGS):
            service = server.service()
            twin = service.create_lora_training_client(str(model_dir), **config).result()
            log = []
            for verb in VERBS:
                step(twin, who, verb, log)
            assert log == logs[who], f"model {who}"
            service.close("success").result()
    finally:
        server.stop()


def test_the_budget_counts_the_shared_base_once(model_dir, tmp_path):
    config = TemperServer.Config(model=[str(model_dir)], storage=str(tmp_path / "storage"))
    server = TemperServer(config, backend=object())  # no model runs here
    base = load_base_model(str(model_dir), trainable=True, sampler=config.sampler, dtype="float32")

    def add(model_id: str, *, rank: int | None) -> None:
        server.sessions.setdefault("s", Session(session_id="s", user="default"))
        served = ServedModel(
            model_id=model_id,
            session_id="s",
            owner="default",
            base=server.base_models.first,
            is_lora=rank is not None,
            lora_rank=rank,
        )
        server.add_model(served)

    add("lora-a", rank=4)
    add("lora-b", rank=4)
    one = base.training_bytes(lora_rank=4, shared_sampler=True)
    held = server.memory.loaded()[base.name]
    # The shared base and the multi-LoRA sampler on it (its weights are the base's).
    assert held == base.sampler_bytes + 2 * one
    # Adapters (rank 4), their gradients and moments, and a snapshot's copy: no base copy.
    assert one == (4 + 1) * 4 * base.lora_bytes_per_rank
    add("full", rank=None)
    assert server.memory.loaded()[base.name] == held + base.training_bytes(lora_rank=None)
    server.drop_model("lora-a")
    server.drop_model("full")
    assert server.memory.loaded()[base.name] == base.sampler_bytes + one
    server.drop_model("lora-b")
    assert base.name not in server.memory.loaded()


def test_a_sharded_trainer_counts_a_base_per_lora_model(model_dir, tmp_path):
    trainer = TrainerEngine.Config(sharding=Sharding.Config())  # --nproc: no sharing
    config = TemperServer.Config(
        model=[str(model_dir)], storage=str(tmp_path / "storage"), trainer=trainer
    )
    server = TemperServer(config, backend=object())
    server.sessions["s"] = Session(session_id="s", user="default")
    base = server.base_models.first
    for model_id in ("a", "b"):
        served = ServedModel(
            model_id=model_id, session_id="s", owner="default", base=base, is_lora=True, lora_rank=4
        )
        server.add_model(served)
    one = base.training_bytes(lora_rank=4, shared_base=False)
    assert one == 4 * 4 * base.lora_bytes_per_rank + base.weights_bytes + base.merged_sampler_bytes
    assert server.memory.loaded()[base.name] == 2 * one
