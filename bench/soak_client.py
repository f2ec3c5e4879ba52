"""One client of bench/server_soak.py: a tinker SDK process doing small RL steps.

Started by the soak as `python bench/soak_client.py SPEC_JSON`; prints its session and model
ids, then one JSON line per SDK call (route, milliseconds, error if any), to its stdout.
"""

from __future__ import annotations

import json
import random
import sys
import time


class StepFailed(Exception):
    """An SDK call of this step raised (already reported on stdout)."""


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def timed(route: str, call):
    """`call()`, reporting its route, milliseconds and outcome as one JSON line on stdout."""
    start = time.perf_counter()
    try:
        result = call()
    except Exception as error:  # every failure is a measured outcome, not a crash
        ms = 1000 * (time.perf_counter() - start)
        emit(event="call", route=route, ms=ms, ok=False, error=f"{type(error).__name__}: {error}")
        raise StepFailed from error
    emit(event="call", route=route, ms=1000 * (time.perf_counter() - start), ok=True)
    return result


def importance_sampling_data(types, prompt: list[int], sequences) -> list:
    """Datums for one group: reward = fraction of sampled tokens equal to prompt[0]."""
    rewards_G = [sum(t == prompt[0] for t in s.tokens) / max(1, len(s.tokens)) for s in sequences]
    mean = sum(rewards_G) / len(rewards_G)
    pad = [0.0] * (len(prompt) - 1)
    data = []
    for sequence, reward in zip(sequences, rewards_G, strict=True):
        tokens = [*prompt, *sequence.tokens]
        loss_fn_inputs = {
            "target_tokens": tokens[1:],
            "logprobs": pad + list(sequence.logprobs),
            "advantages": pad + [reward - mean] * len(sequence.tokens),
        }
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_fn_inputs
            )
        )
    return data


def client_step(training, types, rng: random.Random, spec: dict) -> None:
    sampler = timed(
        "save_weights_and_get_sampling_client",
        lambda: training.save_weights_and_get_sampling_client().result(),
    )
    prompt = [
        rng.randrange(spec["first_token"], spec["vocab_size"]) for _ in range(spec["prompt_tokens"])
    ]
    params = types.SamplingParams(
        max_tokens=spec["max_tokens"], temperature=1.0, seed=rng.randrange(2**31), stop=[]
    )
    result = timed(
        "sample",
        lambda: sampler.sample(
            types.ModelInput.from_ints(prompt), spec["group_size"], params
        ).result(),
    )
    data = importance_sampling_data(types, prompt, result.sequences)
    timed(
        "forward_backward", lambda: training.forward_backward(data, "importance_sampling").result()
    )
    adam = types.AdamParams(learning_rate=spec["learning_rate"])
    timed("optim_step", lambda: training.optim_step(adam).result())


def run_client(spec: dict) -> None:
    """One client: create a LoRA model, report its ids, step until `spec["until"]`, close."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=spec["base_url"], api_key=spec["api_key"])

    def create():
        return service.create_lora_training_client(
            spec["model"], rank=spec["rank"], seed=spec["seed"]
        ).result()

    try:
        training = timed("create_lora_training_client", create)
    except StepFailed:
        sys.exit(1)
    session_id = service.holder.get_session_id()
    emit(event="session", session_id=session_id, model_id=training.model_id)
    rng = random.Random(spec["seed"])
    num_steps = 0
    while time.time() < spec["until"]:
        try:
            client_step(training, types, rng, spec)
            num_steps += 1
        except StepFailed:
            time.sleep(1.0)  # a failing server is not hammered
    service.close("success").result()
    emit(event="done", steps=num_steps)


if __name__ == "__main__":
    run_client(json.loads(sys.argv[1]))
