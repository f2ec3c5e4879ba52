"""A GRPO-style loop written against the tinker SDK learns through the server.

The step is bench/server_overhead.py's (the same code drives the in-process client there).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tinker import types

BENCH = Path(__file__).parents[2] / "bench" / "server_overhead.py"


def load_rl_step():
    spec = importlib.util.spec_from_file_location("server_overhead", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rl_step


def test_grpo_loop_through_the_server_raises_the_reward(server, model_dir):
    rl_step = load_rl_step()
    service = server.service()
    training = service.create_lora_training_client(str(model_dir), rank=16, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompts = [tokenizer.encode(f"{i}{(3 * i) % 10}=") for i in range(8)]
    rewards = [
        rl_step(
            training, types, prompts, group_size=8, max_tokens=8, seed=step, learning_rate=5e-3
        )[0]
        for step in range(10)
    ]
    assert sum(rewards[-3:]) / 3 > 2 * sum(rewards[:3]) / 3
    service.close("success").result()
