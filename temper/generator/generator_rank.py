"""A generator rank of a disaggregated placement: serves the trainer ranks' `RemoteGenerator`s.

The main thread follows the sync control group (trainer rank 0): `Start` builds an empty
model of the trainer's shape and the generator on it (Temper's engine, or vLLM in its own
process), `Weights` receives a version's buckets from every trainer rank's channel in turn
(weight_transfer.py), `Commit` makes it the version sampled from, `Reference` (before or
after `Start`) loads a KL reference (a plain model that only scores, from a sampler
checkpoint), `Stop` ends the job. The buckets land straight in the generator's weights while
no request runs (the rank's lock is held for the whole load): in Temper's engine's model, or
for vLLM, which loads whole tensors by name, through its weight-transfer protocol as each
tensor's rows are all there (distributed/whole_tensors.py: the channels drawn in step, only
tensors still arriving staged). With `overlap_sync` they land in a second copy while
requests on the current version still run, which `Commit` then loads into the generator.

One thread per linked trainer rank answers its calls (generate, score) under one lock, so the
engine runs one batch at a time, and each call waits until the version it names is committed.

A call that fails (a bad request) answers a `Failure` and the rank serves on; a link or the
control group failing ends the rank with a `PeerFailure` (distributed/deadline.py) naming the
trainer rank, the phase and how far it got: a trainer rank that dies fails it at once, and a
weight sync must end within `sync_timeout_s`. Waiting for the next command or call while the
trainers train has no deadline (`IDLE_WAIT`): a trainer that dies closes its connections.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from temper.api.threads import ThreadSettings
from temper.distributed.deadline import (
    IDLE_WAIT,
    Deadlines,
    PeerFailure,
    Progress,
    crossing,
    recv_object,
    send_object,
    wait_idle,
)
from temper.distributed.placement import Link, Roles
from temper.distributed.weight_pieces import rows_of
from temper.distributed.weight_transfer import BucketReceiver, drain
from temper.distributed.whole_tensors import WholeTensors, interleave
from temper.generator.choice import GeneratorChoice
from temper.generator.remote import (
    Answer,
    Commit,
    Failure,
    GenerateCall,
    Reference,
    ReferenceScoreCall,
    ScoreCall,
    Start,
    Stop,
    Weights,
    WeightsCall,
    call_name,
)
from temper.generator.seam import Generator
from temper.models.build import materialize
from temper.sampler.engine import SamplerEngine
from temper.sampler.sequence_scoring import score_sequences
from temper.sampler.weight_source import WeightSource


def keeps_second_copy(*, overlap_sync: bool, backend: GeneratorChoice.Config) -> bool:
    """Whether a generator rank receives new weights into a second copy of them: only to
    overlap the transfer with sampling (either backend)."""
    del backend
    return overlap_sync


class GeneratorRank:
    def __init__(
        self,
        *,
        roles: Roles,
        engine: SamplerEngine.Config,
        backend: GeneratorChoice.Config | None = None,
        device: torch.device,
        overlap_sync: bool = False,
        deadlines: Deadlines | None = None,
        on_start: Callable[[Any], None] | None = None,
        load_reference: Callable[[str, torch.dtype], nn.Module] | None = None,
    ) -> None:
        """`backend`: Temper's engine (set up by `engine`; the default) or vLLM.
        `overlap_sync`: receive new weights into a second copy while sampling (see the
        module docstring). `deadlines`: of a weight sync (the placement's; default: its
        default). `on_start(model_config)`: called once the trainer said which model (a log
        line)."""
        self._roles, self._engine_config, self._device = roles, engine, device
        self._deadlines = deadlines or Deadlines()
        self._who = f"generator rank {roles.rank}"
        self._backend = GeneratorChoice(backend or GeneratorChoice.Config())
        self._overlap_sync = overlap_sync
        self._next: WeightSource | None = None  # the second copy (overlap_sync)
        self._on_start = on_start
        self._load_reference = load_reference
        self._reference: nn.Module | None = None  # the KL reference (scores only)
        self._links = [link for link in roles.links if link.generator == roles.rank]
        self._receiver = BucketReceiver(channels=roles.weight_channels, device=device)
        self._shapes: dict[str, tuple[int, ...]] = {}  # of the model's tensors, in order
        self.whole_tensors = WholeTensors(shapes=self._shapes, device=device)
        """Assembles vLLM's whole tensors (its `peak_staged_bytes`: the last load's)."""
        self._changed = threading.Condition()  # guards the engine and the version
        self._engine: Generator | None = None
        self._version = -1
        self._ended: str | None = None  # why calls can no longer be answered
        self._link_errors: list[BaseException] = []

    def serve(self) -> None:
        """Serve until trainer rank 0 says the job is done; raises if a peer fails."""
        settings = ThreadSettings.of_caller()  # the rank's thread count and GPU
        threads = [
            threading.Thread(target=self._serve_link, args=(link, settings), daemon=True)
            for link in self._links
        ]
        for thread in threads:
            thread.start()
        try:
            while not isinstance(command := self._next_command(), Stop):
                self._follow(command)
        except BaseException as error:
            self._end(f"the generator rank stopped: {error}")
            raise
        finally:
            self._end("the job ended")
            # The links' threads answer nothing more; vLLM's engine process must go before
            # this one can exit.
            if self._engine is not None:
                self._engine.close()
        self._join(threads)
        if self._link_errors:
            raise self._link_errors[0]

    def _join(self, threads: list[threading.Thread]) -> None:
        """The links' threads, once each trainer rank said goodbye: within a sync deadline
        of trainer rank 0's, as every trainer rank ends its job at about the same time."""
        deadline = self._deadlines.sync()
        for thread, link in zip(threads, self._links, strict=True):
            thread.join(timeout=max(deadline.left(), 0.0))
            if thread.is_alive():
                raise PeerFailure(
                    f"{self._who}: trainer rank {link.trainer} did not end its link within "
                    f"{deadline.describe()} s of the job's end; it stalled"
                )

    def _follow(self, command: object) -> None:
        if isinstance(command, Start):
            self._start(command)
        elif isinstance(command, Weights):
            self._receive(command.version)
        elif isinstance(command, Reference):
            self._set_reference(command.directory, dtype=command.dtype)
        else:
            assert isinstance(command, Commit), command
            self._commit(command.version)

    def _start(self, start: Start) -> None:
        """The generator on an empty model of the trainer's shape (its first weights fill it)."""
        if self._on_start is not None:
            self._on_start(start.model_config)
        empty_model = functools.partial(
            materialize, start.model_config, device=self._device, dtype=start.dtype, init="empty"
        )
        model = empty_model()
        self._shapes.update({key: tuple(value.shape) for key, value in model.state_dict().items()})
        engine = self._backend.generator(
            engine=self._engine_config, model=model, tokenizer=start.tokenizer
        )
        del model  # vLLM keeps its own weights; Temper's engine keeps this one
        if keeps_second_copy(overlap_sync=self._overlap_sync, backend=self._backend.config):
            self._next = WeightSource(empty_model())
        with self._changed:
            self._engine = engine

    def _next_command(self) -> Any:
        box: list[Any] = [None]
        trainer = self._roles.trainer_ranks[0]
        group = self._roles.sync_control
        phase = f"waiting for the next command from trainer rank {trainer}"
        with crossing(lambda: phase, who=self._who, deadline=None):
            wait_idle(group)  # the trainers may train for long meanwhile
            dist.broadcast_object_list(box, group=group, group_src=0)
        return box[0]

    def _receive(self, version: int) -> None:
        """The buckets of `version`: into the second copy while requests run, or into the
        engine's weights while none does (then sampled from at once)."""
        assert self._engine is not None
        if self._next is not None:
            self._load(self._next, version=version)
            return
        with self._changed:
            try:
                self._load(self._engine, version=version)
            finally:
                self._version = version
                self._changed.notify_all()

    def _load(self, target: Generator | WeightSource, *, version: int) -> None:
        model = target.model
        if model is None:  # vLLM: whole tensors by name
            self._load_whole(target, version=version)
            return
        stream = self._receiver.receive(into=rows_of(model.state_dict()), **self._sync(version))
        try:
            if isinstance(target, WeightSource):
                target.update(stream, version=version)
            else:
                target.update_weights(stream, version=version)
        finally:
            drain(stream)  # the rest of the buckets, if loading stopped early

    def _load_whole(self, engine: Generator, *, version: int) -> None:
        """Each tensor into the engine once its rows from every channel are there: a receiver
        (a bucket's buffer) per channel, the channels drawn in step, large pieces received
        straight into the whole tensors."""
        into = self.whole_tensors.into
        streams = [
            BucketReceiver(channels=[channel], device=self._device).receive(
                into=into, **self._sync(version)
            )
            for channel in self._roles.weight_channels
        ]
        try:
            pieces = interleave(streams, shapes=self._shapes)
            engine.update_weights(self.whole_tensors(pieces), version=version)
        finally:
            for stream in streams:
                drain(stream)  # the rest of the buckets, if loading stopped early

    def _sync(self, version: int) -> dict[str, Any]:
        """How the receiver names and bounds the sync of `version` (its `receive` settings)."""
        return {
            "who": self._who,
            "what": f"weight sync of version {version}",
            "deadline": self._deadlines.sync(),
            "total_elements": sum(math.prod(shape) for shape in self._shapes.values()),
        }

    def _commit(self, version: int) -> None:
        assert self._engine is not None
        with self._changed:  # once the call running now is answered
            try:
                if self._next is not None:
                    self._engine.update_weights(self._next.model.state_dict(), version=version)
            finally:
                self._version = version
                self._changed.notify_all()

    def _set_reference(self, directory: str, *, dtype: torch.dtype) -> None:
        if self._load_reference is None:
            raise RuntimeError("this generator rank was started without a way to load a reference")
        model = self._load_reference(directory, dtype)
        with self._changed:
            self._reference = model
            self._changed.notify_all()

    def _end(self, why: str) -> None:
        with self._changed:
            if self._ended is None:
                self._ended = why
            self._changed.notify_all()

    def _serve_link(self, link: Link, settings: ThreadSettings) -> None:
        # The rank's own thread count, whatever the other links' generate calls set
        # meanwhile, and its own GPU (a new thread starts on cuda:0).
        settings.apply()
        progress = Progress(f"the link to trainer rank {link.trainer}")
        try:
            with crossing(progress, who=self._who, deadline=None):
                while True:
                    progress.step = "waiting for its next call"
                    call = recv_object(group=link.group, src=0, wait=IDLE_WAIT)
                    if isinstance(call, Stop):
                        break
                    answer = self._answer(call)
                    progress.step = f"sending the answer to its {call_name(call)}"
                    send_object(answer, group=link.group, dst=0)
        except BaseException as error:  # a PeerFailure naming the phase, as a rule
            self._link_errors.append(error)

    def _answer(self, call: object) -> object:
        if isinstance(call, ReferenceScoreCall):
            return self._answer_reference(call)
        with self._changed:
            try:
                assert isinstance(call, GenerateCall | ScoreCall | WeightsCall), call
                self._changed.wait_for(lambda: self._version >= call.version or self._ended)
                if self._ended is not None:
                    return Failure("RuntimeError", self._ended)
                if self._version != call.version:
                    return Failure(
                        "RuntimeError",
                        f"a call on policy version {call.version} came after version "
                        f"{self._version} arrived; a generator rank keeps one version",
                    )
                assert self._engine is not None
                if isinstance(call, WeightsCall):
                    model = self._engine.model
                    if model is None:  # vLLM: read out of its workers (no copy is kept)
                        return self._engine.read_weights()
                    return {k: v.cpu() for k, v in model.state_dict().items()}
                if isinstance(call, GenerateCall):
                    result = self._engine.generate(call.requests)
                else:
                    result = self._engine.score(call.sequences, temperature=call.temperature)
                return Answer(version=self._engine.version, result=result)
            except ValueError as error:
                return Failure("ValueError", str(error))
            except torch.AcceleratorError as error:
                # A CUDA error is sticky: every later kernel of this process fails too, so
                # the rank ends here and says why, rather than answering on with garbage.
                why = f"its device failed ({type(error).__name__}: {error}); it serves no more"
                self._ended = why
                self._changed.notify_all()
                return Failure("RuntimeError", why)
            except Exception as error:
                return Failure("RuntimeError", f"{type(error).__name__}: {error}")

    def _answer_reference(self, call: ReferenceScoreCall) -> object:
        """Scores on the KL reference, once it has loaded; one call at a time with the
        engine's (the same lock)."""
        with self._changed:
            try:
                self._changed.wait_for(lambda: self._reference is not None or self._ended)
                if self._ended is not None:
                    return Failure("RuntimeError", self._ended)
                assert self._reference is not None
                batches = [[s] for s in call.sequences] if call.alone else [call.sequences]
                result = [
                    score
                    for batch in batches
                    for score in score_sequences(
                        self._reference,
                        batch,
                        temperature=call.temperature,
                        max_tokens=self._engine_config.max_score_tokens,
                    )
                ]
                return Answer(version=self._version, result=result)
            except ValueError as error:
                return Failure("ValueError", str(error))
            except Exception as error:
                return Failure("RuntimeError", f"{type(error).__name__}: {error}")
