"""A generator on other ranks: the trainer's side of a disaggregated placement.

`RemoteGenerator` is a `Generator` (seam.py) whose work runs on generator ranks
(generator_rank.py serves it). Each trainer rank holds one, linked to its generators
(placement.py): `generate` and `score` split their batch over those links, send the parts,
and join the answers in order. `update_weights` streams the trainer's weights to every
generator rank in buckets (distributed/weight_transfer.py): every trainer rank sends its own
rows of the FSDP-sharded tensors on its own channel, and trainer rank 0 the rest whole. Every
call carries the policy version it was made on, and a generator answers it from exactly that
version (it waits for weights still on their way), so samples are tagged with the version
they came from.

A generator rank samples from one version at a time (`holds_one_version`). By default it
receives new weights straight into the ones it samples from, so before they go out the
weight-sync layer lets requests on the old version finish (client/weight_sync.py), and the
trainer ranks meet at a barrier so that no rank's old requests are still in flight. With the
placement's `overlap_sync` it receives them into a second copy while it still samples the old
version (`send_weights`, which the weight-sync layer calls as soon as it is asked for the new
version), and switches once the old version's requests have run (`commit_weights`, after the
same barrier): the transfer overlaps sampling.

A KL reference (`load_reference`) loads on the generator ranks too, from the sampler
weights the trainer saved (a path every rank sees), and only scores: the trainer ranks hold
no second model for it.

Every exchange has a deadline (distributed/deadline.py): a weight sync and each command
`sync_timeout_s`, a call (request to whole answer) `call_timeout_s`. A generator rank that
dies, or does not answer within the deadline, fails the exchange with a `PeerFailure` naming
this rank, the generator rank, the phase and how far it got; the link is closed for good,
the job stops and can resume from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from temper.api.types import SampleResponse
from temper.distributed.deadline import (
    Deadline,
    Deadlines,
    PeerFailure,
    crossing,
    recv_object,
    send_object,
)
from temper.distributed.placement import Link, Roles
from temper.distributed.ranks import Ranks
from temper.distributed.weight_pieces import WeightPiece
from temper.distributed.weight_transfer import BucketSender
from temper.sampler.requests import SampleRequest
from temper.sampler.weight_source import WeightUpdate
from temper.tokenizer import Tokenizer

T = TypeVar("T")


# -- what travels: on a link (trainer <-> generator) and on the sync control group -----------


@dataclass(frozen=True)
class GenerateCall:
    version: int
    requests: list[SampleRequest]


@dataclass(frozen=True)
class ScoreCall:
    version: int
    sequences: list[list[int]]
    temperature: float


@dataclass(frozen=True)
class ReferenceScoreCall:
    """Score on the generator's KL reference (`Reference`), which has no version: each
    sequence alone, as one `compute_logprobs` call would be, or (`alone` False) together in
    the engine's token-budget batches, as `compute_logprobs_batch`."""

    sequences: list[list[int]]
    temperature: float
    alone: bool = True


@dataclass(frozen=True)
class WeightsCall:
    """Send back the generator's weights (checks on small models)."""

    version: int


@dataclass(frozen=True)
class Stop:
    """This trainer rank is done (on a link), or the job is (on the sync group)."""


@dataclass(frozen=True)
class Start:
    """The model the generators build (an empty one; the first weights fill it)."""

    model_config: Any
    dtype: torch.dtype
    tokenizer: Tokenizer | None


@dataclass(frozen=True)
class Weights:
    """Buckets of this version's weights follow (into the second copy, with overlap_sync)."""

    version: int


@dataclass(frozen=True)
class Reference:
    """Load the sampler weights saved in `directory` (a path every rank sees), in `dtype`, as
    the KL reference, which only scores: a model without a KV cache, never updated."""

    directory: str
    dtype: torch.dtype


@dataclass(frozen=True)
class Commit:
    """Sample from the version sent last from now on."""

    version: int


@dataclass(frozen=True)
class Answer:
    """A generator's result, tagged with the policy version it was drawn from."""

    version: int
    result: Any


@dataclass(frozen=True)
class Failure:
    """A call the generator refused or failed: raised again on the trainer."""

    kind: str  # "ValueError" (bad input) or "RuntimeError"
    message: str


class RemoteGenerator:
    holds_one_version = True

    def __init__(
        self,
        *,
        roles: Roles,
        links: RemoteLinks,
        model_config: Any,
        dtype: torch.dtype,
        tokenizer: Tokenizer | None,
        bucket_bytes: int,
        transfer_dtype: torch.dtype | None,
        device: torch.device,
        overlap_sync: bool,
        deadlines: Deadlines,
    ) -> None:
        """Collective over the trainer ranks (every one makes its own); trainer rank 0
        tells the generator ranks which model to build."""
        self.overlaps_sync = overlap_sync
        """Weights are sent ahead (`send_weights`) while the current version samples."""
        self._roles, self._links, self._deadlines = roles, links, deadlines
        self._vocab_size = model_config.vocab_size
        self._version = -1  # no weights sent yet
        self._lead = roles.rank == roles.trainer_ranks[0]
        self._sender = BucketSender(
            channel=roles.weight_channels[roles.trainer_world.rank],
            bucket_bytes=bucket_bytes,
            dtype=transfer_dtype,
            device=device,
        )
        if self._lead:
            start = Start(model_config=model_config, dtype=dtype, tokenizer=tokenizer)
            _control(roles, start, deadline=deadlines.sync())

    @property
    def model(self) -> nn.Module | None:
        return None  # the weights live on the generator ranks

    @property
    def version(self) -> int:
        return self._version

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def describe(self) -> str:
        return f"remote generator on {self._links.describe()}"

    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResponse]:
        self._check_weights()
        return self._links.call(
            list(requests), lambda part: GenerateCall(version=self._version, requests=part)
        )

    def score(
        self, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        self._check_weights()
        return self._links.call(
            [list(sequence) for sequence in sequences],
            lambda part: ScoreCall(version=self._version, sequences=part, temperature=temperature),
        )

    def _check_weights(self) -> None:
        if self._version < 0:
            raise RuntimeError("no weights were sent to the generator ranks yet")

    def update_weights(self, source: WeightUpdate, *, version: int) -> None:
        """Send `source` and sample from it from now on (collective over the trainer ranks;
        this rank's requests on the current version have run)."""
        if not self.overlaps_sync:  # the generators load into the weights they sample from
            self._trainers_idle()
        self.send_weights(source, version=version)
        self.commit_weights(version=version)

    def send_weights(self, source: WeightUpdate, *, version: int) -> None:
        """Stream `source`, this trainer rank's share of the weights (checkpoint/gather.py's
        `sampler_share`), to every generator rank (collective over the trainer ranks, which
        each send theirs on their own channel). With `overlaps_sync` the generators go on
        sampling the current version meanwhile, until `commit_weights`."""
        deadline = self._deadlines.sync()
        with self._links.failing():
            if self._lead:
                _control(self._roles, Weights(version=version), deadline=deadline)
            what = f"weight sync of version {version}"
            self._sender.send(_pieces(source), what=what, deadline=deadline)

    def commit_weights(self, *, version: int) -> None:
        """Sample from the version sent last from now on (collective over the trainer ranks,
        each once its requests on the current version have run)."""
        if self.overlaps_sync:
            self._trainers_idle()
        if self._lead:
            with self._links.failing():
                _control(self._roles, Commit(version=version), deadline=self._deadlines.sync())
        self._version = version

    def _trainers_idle(self) -> None:
        """Wait until every trainer rank's requests on the current version have run."""
        world = self._roles.trainer_world
        if world.size > 1:
            dist.barrier(group=world.group)

    def generator_weights(self) -> list[dict[str, torch.Tensor]]:
        """Each linked generator's weights of the current version, on CPU (checks on small
        models)."""
        call = WeightsCall(version=self._version)
        return self._links.exchange([(link, call) for link in self._links.links])

    def sleep(self) -> None:
        """Nothing to release: the generators do not share this rank's memory."""

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        """Nothing of its own to end (`RemoteGenerators.close` ends the links and the job)."""


class RemoteLinks:
    """A trainer rank's links to its generator ranks, shared by the policy's generator and a
    KL reference: a call is split over them in order, one exchange at a time (clients read
    from several threads), and a failed link fails every later call."""

    def __init__(self, roles: Roles, *, deadlines: Deadlines) -> None:
        self.links = [link for link in roles.links if link.trainer == roles.rank]
        self._deadlines = deadlines
        self._generator_ranks = roles.generator_ranks
        self._closed = False
        self._failure: str | None = None  # why a link failed; every later call says it again
        self._talking = threading.Lock()

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def describe(self) -> str:
        generators = ", ".join(str(link.generator) for link in self.links)
        return f"rank(s) {generators} of {self._generator_ranks}"

    def call(self, items: list, make: Callable[[list], object]) -> list:
        """Split `items` over the links in order, one call each, and join the answers."""
        parts = [
            items[Ranks(rank=index, world_size=len(self.links)).split(len(items))]
            for index in range(len(self.links))
        ]
        calls = [(link, make(part)) for link, part in zip(self.links, parts, strict=True) if part]
        return [answer for part in self.exchange(calls) for answer in part]

    def exchange(self, calls: list[tuple[Link, object]]) -> list[Any]:
        """Send every call, then read the answers in order."""
        with self._talking:
            if self._failure is not None:
                raise RuntimeError(self._failure)
            if self._closed:
                raise RuntimeError("the generator ranks' links are closed (the job ended)")
            deadline = self._deadlines.call()
            for link, call in calls:
                self._send(link, call, deadline=deadline)
            return [self._answer(link, call, deadline=deadline) for link, call in calls]

    def close(self) -> None:
        """Tell this rank's generators it is done (once; nothing after a failed link)."""
        with self._talking:
            if self._closed:
                return
            self._closed = True
            deadline = self._deadlines.sync()
            for link in self.links:
                self._send(link, Stop(), deadline=deadline)

    def _answer(self, link: Link, call: object, *, deadline: Deadline) -> Any:
        answer = self._receive(link, call, deadline=deadline)
        if isinstance(answer, Failure):
            error = ValueError if answer.kind == "ValueError" else RuntimeError
            raise error(f"generator rank {link.generator}: {answer.message}")
        if isinstance(answer, Answer):
            expected = getattr(call, "version", answer.version)
            if answer.version != expected:  # a broken contract, never a silent sample
                raise RuntimeError(
                    f"generator rank {link.generator} answered from policy version "
                    f"{answer.version}, not the {expected} asked for"
                )
            answer = answer.result
        return answer

    def _send(self, link: Link, message: object, *, deadline: Deadline) -> None:
        phase = f"{call_name(message)} to generator rank {link.generator}: sending it"
        with self._on_link(link, phase, deadline=deadline):
            send_object(message, group=link.group, dst=1)

    def _receive(self, link: Link, call: object, *, deadline: Deadline) -> Any:
        phase = f"{call_name(call)} to generator rank {link.generator}: waiting for its answer"
        with self._on_link(link, phase, deadline=deadline):
            return recv_object(group=link.group, src=1, wait=deadline.bound(link.group))

    @contextlib.contextmanager
    def failing(self) -> Iterator[None]:
        """A `PeerFailure` inside (on a link, a weight sync or a command) fails every later
        call, and nothing more is sent, not even goodbyes."""
        try:
            yield
        except PeerFailure as failure:
            self._closed = True
            self._failure = str(failure)
            raise

    @contextlib.contextmanager
    def _on_link(self, link: Link, phase: str, *, deadline: Deadline) -> Iterator[None]:
        who = f"trainer rank {link.trainer}"
        with self.failing(), crossing(lambda: phase, who=who, deadline=deadline):
            yield


class RemoteReference:
    """A KL reference on the generator ranks (`RemoteGenerators.load_reference`): a
    `Generator` that only scores (`compute_logprobs`), over the policy's links."""

    holds_one_version = False

    def __init__(self, links: RemoteLinks, *, name: str, vocab_size: int) -> None:
        self._links, self._name, self._vocab_size = links, name, vocab_size

    @property
    def model(self) -> nn.Module | None:
        return None

    @property
    def version(self) -> int:
        return 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def describe(self) -> str:
        return f"KL reference {self._name} on {self._links.describe()} (scores only)"

    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResponse]:
        raise ValueError(
            f"{self._name} was loaded on the generator ranks as a KL reference, which only "
            "scores (compute_logprobs); sample with a client from create_sampling_client"
        )

    def score(
        self, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """The sequences scored together on the generator ranks (each rank's part in its
        engine's token-budget batches)."""
        return self._reference_scores(sequences, temperature=temperature, alone=False)

    def score_alone(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each sequence scored alone on the generator rank, in one round trip."""
        return self._reference_scores(sequences, temperature=1.0, alone=True)

    def _reference_scores(
        self, sequences: Sequence[Sequence[int]], *, temperature: float, alone: bool
    ) -> list[torch.Tensor]:
        return self._links.call(
            [list(sequence) for sequence in sequences],
            lambda part: ReferenceScoreCall(sequences=part, temperature=temperature, alone=alone),
        )

    def update_weights(self, source: WeightUpdate, *, version: int) -> None:
        raise ValueError("a KL reference keeps the weights it was loaded with")

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass


class RemoteGenerators:
    """A trainer rank's way to the generator ranks: makes the one `RemoteGenerator` of the
    job's training client (and any KL reference), and ends the generator ranks' service at
    the end."""

    def __init__(
        self,
        *,
        roles: Roles,
        bucket_bytes: int,
        transfer_dtype: torch.dtype | None,
        device: torch.device,
        overlap_sync: bool = False,
        deadlines: Deadlines | None = None,
    ) -> None:
        """`deadlines`: of a weight sync and of a call (the placement's; default: its
        defaults)."""
        self.roles = roles
        self._bucket_bytes, self._transfer_dtype = bucket_bytes, transfer_dtype
        self._device, self._overlap_sync = device, overlap_sync
        self._deadlines = deadlines or Deadlines()
        self._links = RemoteLinks(roles, deadlines=self._deadlines)
        self._lead = roles.rank == roles.trainer_ranks[0]
        self._ended = False
        self.generator: RemoteGenerator | None = None

    def connect(
        self, *, model_config: Any, dtype: torch.dtype, tokenizer: Tokenizer | None
    ) -> RemoteGenerator:
        """The generator for the job's one policy (collective over the trainer ranks)."""
        if self.generator is not None:
            raise ValueError(
                "the generator ranks serve one training client's policy; this job made a "
                "second training client"
            )
        self.generator = RemoteGenerator(
            roles=self.roles,
            links=self._links,
            model_config=model_config,
            dtype=dtype,
            tokenizer=tokenizer,
            bucket_bytes=self._bucket_bytes,
            transfer_dtype=self._transfer_dtype,
            device=self._device,
            overlap_sync=self._overlap_sync,
            deadlines=self._deadlines,
        )
        return self.generator

    def load_reference(
        self, directory: str, *, dtype: torch.dtype, vocab_size: int
    ) -> RemoteReference:
        """The generator ranks load the sampler weights saved in `directory` (a path every
        rank sees) in `dtype`, as a KL reference that scores sequences; its generator here
        (collective over the trainer ranks, before or after `connect`)."""
        if self._lead:
            reference = Reference(directory=directory, dtype=dtype)
            with self._links.failing():
                _control(self.roles, reference, deadline=self._deadlines.sync())
        return RemoteReference(self._links, name=directory, vocab_size=vocab_size)

    def close(self) -> None:
        """Every trainer rank calls it once at the end (also when nothing was sampled): its
        links end, and trainer rank 0 ends the job (unless a generator rank failed: then
        nothing more is sent)."""
        if self._ended or self._links.failed:
            return
        self._ended = True
        self._links.close()
        if self._lead:
            _control(self.roles, Stop(), deadline=self._deadlines.sync())


def _control(roles: Roles, message: object, *, deadline: Deadline) -> None:
    """Trainer rank 0 to every generator rank (and the other trainer ranks' copies of it)."""
    group = roles.sync_control
    phase = f"sending the command {call_name(message)} to generator ranks {roles.generator_ranks}"
    with crossing(lambda: phase, who=f"trainer rank {roles.rank}", deadline=deadline):
        deadline.bound(group)
        dist.broadcast_object_list([message], group=group, group_src=0)


def call_name(message: object) -> str:
    """A call or command as a failure's message names it: 'generate call on policy version 3'."""
    names = {
        GenerateCall: "generate call",
        ScoreCall: "score call",
        ReferenceScoreCall: "KL reference score call",
        WeightsCall: "weights check",
        Stop: "stop",
        Start: "start",
        Weights: "weights",
        Reference: "reference",
        Commit: "commit",
    }
    name = names.get(type(message), type(message).__name__)
    version = getattr(message, "version", None)
    return name if version is None else f"{name} on policy version {version}"


def _pieces(source: WeightUpdate) -> Iterator[WeightPiece]:
    if isinstance(source, nn.Module):
        return iter(source.state_dict().items())
    if isinstance(source, Mapping):
        return iter(source.items())
    return iter(source)
