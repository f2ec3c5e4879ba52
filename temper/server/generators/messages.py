"""What rank 0 and a generator rank of a disaggregated server say to each other, and the link
that carries it.

A link is one socket (multiprocessing.connection, authenticated by a key the launcher draws)
carrying framed pickles both ways. Rank 0 tags each request with an id and the generator rank
answers it with a `Reply` under the same id, in whatever order its calls finish, so many
calls are in flight on one link: sends take the link's lock, and each side reads on a thread
of its own, so a send never waits on a receive. The socket is not a torch.distributed group on
purpose: a generator rank that dies closes it, rank 0's reader sees that at once, and no
collective that could hang includes a generator rank.

Plain `pickle` (protocol 5), never torch.multiprocessing's pickler, which would pass tensors
as shared-memory handles that an unrelated process cannot open.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from temper.api.types import ModelInput
from temper.models.lora import LoraConfig


@dataclass(frozen=True)
class Hello:
    """A generator rank's first message: which one it is."""

    index: int
    pid: int


@dataclass(frozen=True)
class LoadBase:
    """Serve base model `base_model` under `key` (loaded on first use, in this rank's dtype)."""

    key: str
    base_model: str


@dataclass(frozen=True)
class LoadCheckpoint:
    """Serve the sampler checkpoint `model_path` (read from the shared storage) under `key`."""

    key: str
    model_path: str
    base_model: str
    """The served base model it was trained on (what its sampler counts)."""


@dataclass(frozen=True)
class LoadAdapter:
    """Serve a LoRA snapshot under `key`: `tensors` (lora_state_dict names) on the base
    model's multi-LoRA sampler, which the snapshots of every LoRA model on it share."""

    key: str
    model_id: str
    base_model: str
    lora: LoraConfig
    tensors: dict[str, torch.Tensor]
    version: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class LoadWeights:
    """Serve a snapshot of whole weights under `key` (full fine-tuning, or merged LoRA where
    multi-LoRA sampling is off): a plain model of `model_config` holding `tensors`."""

    key: str
    model_id: str
    base_model: str
    model_config: Any
    """The model family's config dataclass (`merged_config` of the trainer's model)."""
    tensors: dict[str, torch.Tensor]
    version: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class LoadInflight:
    """Serve, or move on, a training model's in-flight target under `key` (client/
    inflight.py): a rank that does not hold it builds it on `load`'s weights; one that does
    offers them to it (its call in progress takes them between decode steps). `save` counts
    the target's in-flight saves on rank 0: a rank ignores one no newer than it holds."""

    load: LoadAdapter | LoadWeights
    save: int

    @property
    def key(self) -> str:
        return self.load.key


Load = LoadBase | LoadCheckpoint | LoadAdapter | LoadWeights | LoadInflight


@dataclass(frozen=True)
class Drop:
    """Forget `key` (rank 0 released its sampling client)."""

    key: str


@dataclass(frozen=True)
class Sample:
    """`SamplingClient.sample(prompt, **options)` on the sampler held under `key`."""

    key: str
    prompt: ModelInput
    options: dict[str, Any] = field(default_factory=dict)
    namespace: int | None = None
    """An in-flight client's prefix-cache namespace (rank 0 numbers them); None otherwise."""

    @property
    def num_sequences(self) -> int:
        """Sequences it decodes (what a rank's load counts)."""
        num_samples = self.options.get("num_samples", 1)
        return num_samples if isinstance(num_samples, int) else 1


@dataclass(frozen=True)
class Score:
    """`SamplingClient.compute_logprobs(prompt)` on the sampler held under `key`."""

    key: str
    prompt: ModelInput
    namespace: int | None = None
    """As `Sample.namespace`."""


@dataclass(frozen=True)
class Request:
    call_id: int
    op: Load | Drop | Sample | Score


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any = None
    error: BaseException | None = None


class Link:
    """One end of a connection: `send` from any thread, `receive` from one."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._send_lock = threading.Lock()

    def send(self, message: object) -> None:
        data = pickle.dumps(message, protocol=5)
        with self._send_lock:
            self.connection.send_bytes(data)

    def receive(self) -> Any:
        """The next message; EOFError/OSError once the other end is gone."""
        return pickle.loads(self.connection.recv_bytes())

    def close(self) -> None:
        """Close the link; a thread blocked in `receive` on it gets EOFError."""
        try:  # shutdown wakes a blocked read, which close alone does not
            with socket.socket(fileno=os.dup(self.connection.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.connection.close()
