"""Helper processes that decode a share of a CPU `generate` call (`cpu.processes`).

A small model's CPU decode is a few thousand small ops issued from Python, one after another:
intra-op threads do not pay at that size, and threads that split the rows wait on each other
for the GIL around every op (decode_shards.py). Processes share no GIL. With
`cpu.processes = N`, a `ProcessSplitSampler` (process_split.py) splits a large enough call's
requests into up to N consecutive parts of about equal numbers of samples, decodes the first
part on its own engine and hands the others to helper processes, each with an engine of its
own (same config with one process, its own KV cache) over the same weight tensors. Responses
come back in request order.

Weights are not copied per update: the first time a module goes to the helpers, its tensors
move into shared memory (torch.multiprocessing; values unchanged), and the helpers map the
same pages. An optimizer step that writes the trainer's parameters in place is then visible
to the helpers at once; after the `update_weights` that follows it (a new weights
generation, weight_source.py) the helpers are only told to rebuild their decode twins (fused
or packed copies of the projections). A module whose tensors have new storage (another
module, or tensors replaced) is sent again. The engine decodes only while no trainer writes
(the clients' weight lock), so a helper never reads a half-written step.

A split call returns what an unsplit one would: every request is validated and given its
seed before it is split (unseeded ones draw from the engine's entropy in request order, as
an unsplit call does), and a seeded request's tokens do not depend on which others share its
batch. Its logprobs may differ in the last bits, as with any other batch composition (a
smaller batch can take another matmul kernel or attend over another cache width).

Helpers start on first use (about 1-2 s each: a fresh interpreter imports torch) as plain
child interpreters that import only this module (helper_launch.py): not forked (the parent
has threads and OpenMP pools), and unlike multiprocessing's spawn they never re-run the
parent's `__main__`, so scripts need no `if __name__ == "__main__":` guard. A helper that
cannot start, cannot take the weights, or dies is dropped with a warning, and
its share runs in the engine's own process: the call still returns the same results. So do
weights too large for the shared-memory filesystem's free space (checked before they move:
writing past its end would kill the process with SIGBUS, not raise).
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
import torch.multiprocessing  # registers the tensor reductions that share storage
from torch import nn

from temper.api.types import SampleResponse
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.cpu.helper_launch import ChildProcess, launch
from temper.sampler.requests import SampleRequest
from temper.tokenizer import Tokenizer


class EngineConfig(Protocol):
    """What the helpers build their engines from: a `SamplerEngine.Config` (this module does
    not import the engine, whose config builds the `ProcessSplitSampler` that uses it)."""

    cpu: CpuDecoding.Config

    def build(self, *, model: nn.Module, tokenizer: Tokenizer | None) -> Any: ...


@dataclass(frozen=True)
class _WeightsSent:
    """What the helpers hold: the module, its tensors' storage, and the weights generation
    their values are from."""

    model_id: int
    pointers: tuple[int, ...]
    generation: int


class HelperProcesses:
    """Up to `max_helpers` helper engines in other processes, started as calls need them."""

    def __init__(
        self,
        *,
        max_helpers: int,
        min_rows: int,
        config: EngineConfig,
        tokenizer: Tokenizer | None,
        threads: int,
    ) -> None:
        """`config` builds each helper's engine (`config.build(model=..., tokenizer=...)`):
        one process, on `threads` threads."""
        self.max_helpers = max_helpers
        self.min_rows = min_rows
        self.threads = threads
        """Intra-op threads of each process in a split call (the engine's part too): the
        processes share the cores."""
        self._config = config
        self._tokenizer = tokenizer
        self._helpers: list[ChildProcess] = []
        self._sent: _WeightsSent | None = None
        self._failed = False  # after a failure, every call runs in the engine's process

    @property
    def num_running(self) -> int:
        return len(self._helpers)

    def plan(self, requests: Sequence[SampleRequest]) -> list[range]:
        """Consecutive request ranges, one per process; one range means: do not split.

        Each part holds at least `min_rows` samples, and the parts' sample counts are as
        even as whole requests allow."""
        rows = [request.num_samples for request in requests]
        num_parts = min(self.max_helpers + 1, len(rows), sum(rows) // self.min_rows)
        if self._failed or num_parts < 2:
            return [range(len(rows))]
        return _balanced_ranges(rows, num_parts)

    def run(
        self,
        parts: list[Sequence[SampleRequest]],
        *,
        model: nn.Module,
        generation: int,
        version: int,
        local: Callable[[Sequence[SampleRequest]], list[SampleResponse]],
    ) -> list[SampleResponse]:
        """`local(parts[0])` here while helpers decode the other parts; responses in order.
        `model` is the one to decode with, at weights `generation` and policy `version`.

        The requests must be validated and seeded already (see the module docstring)."""
        remote = parts[1:]
        try:
            weights = self._weights_message(model, generation=generation, version=version)
        except _NoRoomToShare as error:
            self._fail(str(error))
            return [response for part in parts for response in local(part)]
        self._grow(len(remote))
        sent: list[tuple[ChildProcess, Sequence[SampleRequest]]] = []
        leftover: list[Sequence[SampleRequest]] = []
        for helper, part in zip(self._helpers, remote, strict=False):
            try:
                helper.connection.send(("generate", weights, part))
                sent.append((helper, part))
            except Exception as error:  # pickling the weights, a closed pipe
                self._fail(f"could not send work to a helper process ({error!r})")
                leftover.append(part)
        leftover.extend(remote[len(sent) + len(leftover) :])
        try:
            responses = local(parts[0])
        finally:  # drained even if the local part raised, so no reply is left for a later call
            replies = [self._reply(helper) for helper, _ in sent]
        error: BaseException | None = None
        for (_, part), reply in zip(sent, replies, strict=True):
            if reply is None:  # the helper is gone: decode its part here
                responses.extend(local(part))
            elif reply[0] == "ok":
                responses.extend(reply[1])
            else:
                error = error or reply[1]
        if error is not None:
            raise error
        for part in leftover:
            responses.extend(local(part))
        return responses

    def _reply(self, helper: ChildProcess) -> tuple[str, Any] | None:
        try:
            return helper.connection.recv()
        except (EOFError, OSError) as lost:
            self._fail(f"a helper process exited ({lost!r})")
            return None

    def close(self) -> None:
        helpers, self._helpers, self._sent = self._helpers, [], None
        for helper in helpers:
            helper.close()

    def _grow(self, count: int) -> None:
        while len(self._helpers) < count and not self._failed:
            name = f"sampler helper process {len(self._helpers)}"
            try:
                helper = launch("temper.sampler.cpu.helper_processes:serve", name=name)
                helper.connection.send((self._config, self._tokenizer))
            except Exception as error:  # cannot start, or the config does not pickle
                self._fail(f"could not start a helper process ({error!r})")
                return
            self._helpers.append(helper)
            self._sent = None  # a new helper holds no weights yet

    def _weights_message(
        self, model: nn.Module, *, generation: int, version: int
    ) -> tuple[nn.Module | None, int] | None:
        """None if the helpers hold `model` at this weights generation; else (module or
        None, version): the module when its storage is new to them, None when only its
        values changed (the helpers rebuild their decode twins)."""
        tensors = [*model.parameters(), *model.buffers()]
        sent = self._sent
        if sent is not None and sent.model_id == id(model) and sent.pointers == _pointers(tensors):
            if sent.generation == generation:
                return None
            self._sent = replace(sent, generation=generation)
            return (None, version)
        # Sending shares each tensor's storage; the first time, that moves it into shared
        # memory (new pointers, same values). Move them now so the record below is final.
        _check_room_to_share(tensors)
        for tensor in tensors:
            tensor.share_memory_()
        self._sent = _WeightsSent(
            model_id=id(model), pointers=_pointers(tensors), generation=generation
        )
        return (model, version)

    def _fail(self, reason: str) -> None:
        if not self._failed:
            warnings.warn(
                f"sampler: {reason}; decoding in the engine's own process from now on "
                "(SamplerEngine.Config.cpu.processes)",
                RuntimeWarning,
                stacklevel=3,
            )
        self._failed = True
        self.close()


SHARED_MEMORY_DIR = "/dev/shm"
"""Where torch puts the storage it shares (Linux); a container's is often only 64 MiB."""


class _NoRoomToShare(RuntimeError):
    pass


def _check_room_to_share(tensors: list[torch.Tensor]) -> None:
    """Raise `_NoRoomToShare` if the tensors' storage not yet shared would not fit in the
    shared-memory filesystem: past its end, writing into a shared page kills the process with
    SIGBUS instead of raising."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
    needed = sum(s.nbytes() for s in storages.values() if not s.is_shared())
    free = shared_memory_free_bytes()
    if free is not None and needed > free:
        raise _NoRoomToShare(
            f"the weights need {needed / 2**20:.0f} MiB of shared memory to reach helper "
            f"processes, and {SHARED_MEMORY_DIR} has {free / 2**20:.0f} MiB free (in a "
            "container, raise it: docker run --shm-size)"
        )


def shared_memory_free_bytes() -> int | None:
    """Free bytes of the shared-memory filesystem; None where there is none to check."""
    try:
        stats = os.statvfs(SHARED_MEMORY_DIR)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _pointers(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(tensor.data_ptr() for tensor in tensors)


def _balanced_ranges(rows: Sequence[int], num_parts: int) -> list[range]:
    """`num_parts` non-empty consecutive ranges of `rows` whose sums are close to even: each
    cut falls at the request boundary nearest its share of the total."""
    total, bounds, cumulative = sum(rows), [0], 0
    cuts = iter(total * part / num_parts for part in range(1, num_parts))
    target = next(cuts)
    for index, count in enumerate(rows[:-1], start=1):
        cumulative += count
        remaining_cuts = num_parts - len(bounds)
        if remaining_cuts == 0:
            break
        # Cut here if this boundary is at least as close to the target as the next one, or
        # if every remaining request must start a part of its own.
        next_cumulative = cumulative + rows[index]
        closest = abs(cumulative - target) <= abs(next_cumulative - target)
        if closest or len(rows) - index == remaining_cuts:
            bounds.append(index)
            target = next(cuts, total)
    bounds.append(len(rows))
    return [range(start, stop) for start, stop in itertools.pairwise(bounds)]


def serve(connection: Connection) -> None:
    """A helper process: take the engine config and tokenizer, then decode each part it is
    sent, until told to stop or the connection closes."""
    try:
        config, tokenizer = connection.recv()
    except (EOFError, OSError):
        return
    torch.set_num_threads(config.cpu.num_threads)  # an int: ProcessSplitSampler sets it
    engine = None  # built from the first weights (the config is one process: no helpers)
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        _, weights, requests = message
        try:
            if weights is not None:
                model, version = weights
                if engine is None:
                    engine = config.build(model=model, tokenizer=tokenizer)
                # Values changed in place (or a new module): a new weights generation, so
                # the engine rebuilds its decode twins.
                engine.update_weights(model if model is not None else engine.model, version=version)
            assert engine is not None, "a helper's first part comes with the weights"
            reply = ("ok", engine.generate(requests))
        except Exception as error:
            reply = ("error", error)
        connection.send(reply)
