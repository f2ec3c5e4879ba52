"""A disaggregated server's generator rank holding an in-flight target of whole weights (full
fine-tuning), driven over its link as rank 0 drives it: the first save builds the target,
a newer one moves it on, an older one sent again is ignored, and a drop forgets it (the LoRA
target, and a save taken mid-sample, run end to end in tests/server/test_disaggregated.py)."""

from __future__ import annotations

import threading
from multiprocessing import Pipe

import pytest

from temper import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from temper.models.lora import merged_config
from temper.server.generators.messages import (
    Drop,
    Link,
    LoadInflight,
    LoadWeights,
    Request,
    Sample,
)
from temper.server.generators.rank import GeneratorRank

GREEDY = SamplingParams(max_tokens=5, temperature=0, stop=[])
PROMPT = ModelInput.from_ints([5, 6, 7])


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return ServiceClient(storage_dir=tmp_path_factory.mktemp("storage"))


class RankZero:
    """Rank 0's end of the link to one generator rank serving on a thread."""

    def __init__(self, service: ServiceClient) -> None:
        ours, theirs = Pipe()
        self.link = Link(ours)
        rank = GeneratorRank(service, link=Link(theirs), index=0)
        self.thread = threading.Thread(target=rank.serve, daemon=True)
        self.thread.start()
        self.calls = 0

    def ask(self, op):
        self.calls += 1
        self.link.send(Request(self.calls, op))
        reply = self.link.receive()
        assert reply.call_id == self.calls
        if reply.error is not None:
            raise reply.error
        return reply.value

    def close(self) -> None:
        self.link.close()
        self.thread.join(timeout=30)


def _save(training, *, save: int) -> LoadInflight:
    engine = training.engine
    tensors = {name: t.detach().clone() for name, t in engine.model.state_dict().items()}
    weights = LoadWeights(
        key="inflight:m",
        model_id="m",
        base_model="tiny",
        model_config=merged_config(engine.model),
        tensors=tensors,
        version=engine.policy_version,
    )
    return LoadInflight(load=weights, save=save)


def _step(training):
    tokens = [3, 4, 5, 6]
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 3},
    )
    training.forward_backward([datum], "cross_entropy")
    training.optim_step(AdamParams(learning_rate=5e-2)).result()


def test_a_generator_rank_moves_its_inflight_target_on_with_each_newer_save(service):
    training = service.create_training_client("tiny")
    rank = RankZero(service)
    try:

        def sample(namespace: int = 1):
            options = dict(num_samples=1, sampling_params=GREEDY)
            op = Sample("inflight:m", prompt=PROMPT, options=options, namespace=namespace)
            return rank.ask(op).sequences[0]

        def expected():
            snapshot = training.save_weights_and_get_sampling_client()
            return snapshot.sample(PROMPT, 1, GREEDY).result().sequences[0]

        first = _save(training, save=1)
        rank.ask(first)
        before = sample()
        assert before.tokens == expected().tokens and before.weight_versions == (0,)
        _step(training)
        rank.ask(_save(training, save=2))
        after = sample(namespace=2)  # another client of the target
        reference = expected()
        assert after.tokens == reference.tokens and after.weight_versions == (1,)
        assert after.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
        assert after.logprobs != pytest.approx(before.logprobs, abs=1e-5)
        rank.ask(first)  # an older save sent again: ignored
        assert sample().logprobs == after.logprobs
        rank.ask(Drop("inflight:m"))
        with pytest.raises(ValueError, match="does not hold sampler 'inflight:m'"):
            sample()
    finally:
        rank.close()
