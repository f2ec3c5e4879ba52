"""One client of bench/server_load.py: a tinker SDK process in one role, every call on a deadline.

Started as `python bench/load_client.py SPEC_JSON`. It imports the SDK, waits for the line
`set-up` on its stdin (the server answers), sets up (a LoRA training model, or a sampling
client on the second base model), prints `{"event": "ready"}`, waits for the line
`go UNTIL` on its stdin (UNTIL: the epoch second at which it stops starting steps), then loops
its role's step and prints one JSON line per attempt of an SDK call to its stdout:
`{"event": "call", "verb", "start", "end" (epoch seconds), "ok", "kind" (the error's kind or
null), "attempt" (0 first), "tokens" (sampled tokens)}`.

Roles:
- `rl`: `save_weights_and_get_sampling_client`, one `sample` of a group, `forward_backward`
  ("importance_sampling", group-relative advantages of a toy reward), `optim_step`.
- `lora_sampler`: a LoRA model of its own (its adapter), one snapshot of it, then `sample`
  in a loop: the server batches many such clients' adapters together.
- `base_sampler`: `sample` and `compute_logprobs` on a base model (the second, sample-only one).

Each attempt waits at most `deadline_s` (`future.result(timeout=...)`): one that does not
answer by then is the kind `deadline` (a hang) and is not retried. An attempt that fails with a
retryable kind (5xx, 408/409/429, a connection error, a failed future not in the `user`
category) is tried again, up to `retries` times; a step whose call fails for good is dropped.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from concurrent.futures import TimeoutError as FutureTimeout

from soak_client import importance_sampling_data

RETRYABLE_STATUSES = {408, 409, 429}


class CallFailed(Exception):
    """An SDK call failed for good (every attempt reported on stdout)."""


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def error_kind(error: BaseException) -> str:
    """A short name for a failure: `deadline`, `http_503`, `connection`, `failed_server`, ..."""
    import tinker

    if isinstance(error, FutureTimeout | TimeoutError):
        return "deadline"
    if isinstance(error, tinker.APIStatusError):
        return f"http_{error.status_code}"
    if isinstance(error, tinker.APIConnectionError):
        return "connection"
    if isinstance(error, tinker.RequestFailedError):
        return f"failed_{error.category}"
    return f"other_{type(error).__name__}"


def is_retryable(kind: str) -> bool:
    if kind.startswith("http_"):
        status = int(kind.removeprefix("http_"))
        return status >= 500 or status in RETRYABLE_STATUSES
    return kind in ("connection", "failed_server", "failed_unknown")


class Caller:
    """Runs SDK calls on a deadline, retries the retryable failures, reports every attempt."""

    def __init__(self, *, deadline_s: float, retries: int) -> None:
        self.deadline_s, self.retries = deadline_s, retries

    def __call__(self, verb: str, submit, *, tokens=lambda result: 0):
        """`submit()` returns an APIFuture; its result, or CallFailed after the last attempt."""
        for attempt in range(self.retries + 1):
            start = time.time()
            try:
                result = submit().result(timeout=self.deadline_s)
            except Exception as error:  # every failure is a measured outcome, not a crash
                kind = error_kind(error)
                detail = f"{type(error).__name__}: {error}"[:300]
                self.report(verb, start=start, attempt=attempt, kind=kind, detail=detail)
                if kind == "deadline" or not is_retryable(kind):
                    raise CallFailed from error
                continue
            self.report(verb, start=start, attempt=attempt, tokens=tokens(result))
            return result
        raise CallFailed

    @staticmethod
    def report(verb: str, *, start: float, attempt: int, kind=None, detail=None, tokens=0) -> None:
        """One attempt's line: ok when it has no error `kind`."""
        ok = kind is None
        fields = {"verb": verb, "start": start, "end": time.time(), "ok": ok, "kind": kind}
        emit(event="call", **fields, attempt=attempt, tokens=tokens, detail=detail)


def sampled_tokens(result) -> int:
    return sum(len(sequence.tokens) for sequence in result.sequences)


def random_prompt(rng: random.Random, spec: dict) -> list[int]:
    low, high = spec["first_token"], spec["vocab_size"]
    return [rng.randrange(low, high) for _ in range(spec["prompt_tokens"])]


class Client:
    """One role's setup and step."""

    def __init__(self, spec: dict) -> None:
        import tinker
        from tinker import types

        self.spec, self.types = spec, types
        self.rng = random.Random(spec["seed"])
        self.call = Caller(deadline_s=spec["deadline_s"], retries=spec["retries"])
        self.service = tinker.ServiceClient(base_url=spec["base_url"], api_key=spec["api_key"])
        self.training = self.sampler = None
        self.num_steps = 0

    def set_up(self) -> None:
        spec = self.spec
        if spec["role"] == "base_sampler":
            self.sampler = self.call(
                "create_sampling_client",
                lambda: self.service.create_sampling_client(base_model=spec["model"]),
            )
            return
        self.training = self.call(
            "create_lora_training_client",
            lambda: self.service.create_lora_training_client(
                spec["model"], rank=spec["rank"], seed=spec["seed"]
            ),
        )
        if spec["role"] == "lora_sampler":
            self.sampler = self.snapshot()

    def snapshot(self):
        return self.call(
            "save_weights_and_get_sampling_client",
            lambda: self.training.save_weights_and_get_sampling_client(),
        )

    def sample(self, sampler, prompt: list[int]):
        params = self.types.SamplingParams(
            max_tokens=self.spec["max_tokens"],
            temperature=1.0,
            seed=self.rng.randrange(2**31),
            stop=[],
        )
        model_input = self.types.ModelInput.from_ints(prompt)
        return self.call(
            "sample",
            lambda: sampler.sample(model_input, self.spec["group_size"], params),
            tokens=sampled_tokens,
        )

    def step(self) -> None:
        prompt = random_prompt(self.rng, self.spec)
        if self.spec["role"] == "rl":
            sampler = self.snapshot()
            result = self.sample(sampler, prompt)
            data = importance_sampling_data(self.types, prompt, result.sequences)
            self.call(
                "forward_backward",
                lambda: self.training.forward_backward(data, "importance_sampling"),
            )
            adam = self.types.AdamParams(learning_rate=self.spec["learning_rate"])
            self.call("optim_step", lambda: self.training.optim_step(adam))
        elif self.spec["role"] == "lora_sampler":
            self.sample(self.sampler, prompt)
        else:
            self.sample(self.sampler, prompt)
            if self.num_steps % self.spec["logprobs_every"] == 0:
                model_input = self.types.ModelInput.from_ints(prompt)
                self.call("compute_logprobs", lambda: self.sampler.compute_logprobs(model_input))
        self.num_steps += 1


def run_client(spec: dict) -> None:
    import tinker  # noqa: F401 (imported while the server starts)

    sys.stdin.readline()  # "set-up": the server answers
    client = Client(spec)
    try:
        client.set_up()
    except CallFailed:
        emit(event="done", steps=0, set_up=False)
        return
    emit(event="ready")
    until = float(sys.stdin.readline().split()[1])
    while time.time() < until:
        try:
            client.step()
        except CallFailed:
            time.sleep(0.2)  # a failing server is not hammered
    emit(event="done", steps=client.num_steps, set_up=True)
    # Ends the session (and its models) with its own deadline; the server going down next
    # ends it too.
    with contextlib.suppress(Exception):  # the figures are in; closing is a courtesy
        client.service.close("success").result(timeout=spec["deadline_s"])


if __name__ == "__main__":
    run_client(json.loads(sys.argv[1]))
