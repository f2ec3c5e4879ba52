"""New weights into a running vLLM engine through vLLM's weight-transfer protocol.

This module is the one place that knows vLLM's weight-transfer interface (a vLLM upgrade
touches only it). Every update runs vLLM's four phases: `init_weight_transfer_engine` once
per engine, then per version `start_weight_update`, `update_weights` (buckets of at most
`BUCKET_BYTES`, never the whole model at once), and `finish_weight_update` with the policy
version as vLLM's weight version (`LLM.get_weight_version()` reads it back).

The worker side is `TemperTransferEngine`, registered in vLLM's
`WeightTransferEngineFactory` as `ENGINE_NAME`. vLLM's own processes (its engine process,
tensor-parallel workers) find it because the engine is started with this module's
`TemperWorkerExtension` as `worker_extension_cls`: every vLLM worker imports this module
before it loads its model, and the import registers the engine there (registration is
idempotent). It receives each bucket through `vllm_reload.InPlaceReload` (`start` at
`start_weight_update`, `load` per bucket, `finish` at `finish_weight_update`): vLLM's own
weight loaders, straight into the live tensors of the layers vLLM keeps as the checkpoint has
them, and vLLM's layerwise reload for the others. Its two transports:
- 'inline': vLLM runs in this process: one `update_weights` request per bucket, its tensors
  in the request itself (no copy before vLLM's own into its weights);
- 'gloo': vLLM runs in its own processes (a separate engine process, tensor parallelism);
  the sender (this process, rank 0) and every vLLM worker (ranks 1..tp) form a gloo group
  of their own, and one `update_weights` request streams every bucket over it
  (distributed/bucket_stream.py): a worker loads bucket k while bucket k+1 arrives, and
  acknowledges each, so no more than two are in flight and the deadline knows how far the
  load got.
On CUDA the same engine runs (its buckets are staged in host memory); the stream runs as it
is over an NCCL group between distinct GPUs, but a generator rank's vLLM sits on the rank's
own GPU, where NCCL cannot pair two ranks and CUDA IPC would be the way: not wired here
(docs/sampler.md).

Every update has a deadline (`timeout_s`): a worker that stalls or dies mid-transfer raises
a `TimeoutError` naming the worker ranks, the phase and how far the transfer got, within
the deadline. In one process there is no peer to wait on, so the inline transport has none.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from temper.distributed import bucket_stream
from temper.generator.vllm_reload import InPlaceReload

ENGINE_NAME = "temper"
"""The name of Temper's engine in vLLM's WeightTransferEngineFactory."""
BUCKET_BYTES = 64 * 2**20
"""Bytes of weights per `update_weights` request (a larger tensor goes alone)."""
STALL_ENV = "TEMPER_TEST_VLLM_TRANSFER_STALL"
"""Tests only: 'N:SECONDS' makes every worker sleep SECONDS before receiving bucket N
(counted from 1 in each update), to stand for a stalled peer."""

Transport = Literal["inline", "gloo"]


def transfer_arguments() -> dict[str, Any]:
    """The `vllm.LLM` keyword arguments that let the engine take weights from `VllmTransfer`."""
    return {
        "weight_transfer_config": {"backend": ENGINE_NAME},
        "worker_extension_cls": f"{__name__}.TemperWorkerExtension",
    }


class TemperWorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`): importing it there is what
    registers `TemperTransferEngine` in that process. Its method is what `collective_rpc`
    calls by name (vLLM's own processes take no function from the caller)."""

    def temper_weight_shards(self) -> dict[str, Any]:
        """This worker's weights by HF name (vllm_readback.py)."""
        from temper.generator.vllm_readback import worker_shards

        return worker_shards(self)


# -- the worker side (inside vLLM's workers) ----------------------------------------------


def _engine_class() -> type:
    """`TemperTransferEngine`, defined on first use (its base class is vLLM's)."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class InitInfo(WeightTransferInitInfo):
        transport: str
        tied: bool
        timeout_s: float
        master_address: str = ""
        master_port: int = 0
        world_size: int = 1

    @dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        # inline transport: one bucket, its tensors in the request
        names: list[str] = field(default_factory=list)
        dtype_names: list[str] = field(default_factory=list)
        shapes: list[list[int]] = field(default_factory=list)
        tensors: list[torch.Tensor] | None = None
        streamed: bool = False  # gloo transport: every bucket, streamed (bucket_stream.py)

    class TemperTransferEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
        """Receives buckets (inline or over gloo) into the model (vllm_reload.py)."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.init_info: InitInfo | None = None
            self.group: Any = None
            self.buckets = 0
            self.reload: InPlaceReload | None = None

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            self.init_info = init_info
            if init_info.transport == "gloo":
                from vllm.distributed import get_tensor_model_parallel_rank

                self.group = _gloo_group(
                    init_info, rank=1 + get_tensor_model_parallel_rank(), is_master=False
                )

        def start_weight_update(self) -> None:
            self.buckets = 0
            self.reload = InPlaceReload(self.model, model_config=self.model_config)
            self.reload.start()

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # vLLM's base class synchronizes an accelerator, which a CPU worker has not.
            self.receive_weights(self.parse_update_info(update_info))
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: UpdateInfo) -> None:
            assert self.reload is not None
            if update_info.streamed:
                # vLLM keeps the tensors of a layer not yet complete: each bucket has its
                # own buffer, freed once vLLM lets go of it.
                self.buckets += bucket_stream.receive(
                    self.group,
                    device=torch.device("cpu"),
                    load=self.reload.load,
                    before_load=lambda number: _maybe_stall(self.buckets + number),
                )
                return
            self.buckets += 1
            _maybe_stall(self.buckets)
            assert update_info.tensors is not None
            self.reload.load(zip(update_info.names, update_info.tensors, strict=True))

        def finish_weight_update(self) -> None:
            assert self.reload is not None
            self.reload.finish()
            self.reload = None

        def shutdown(self) -> None:
            self.group = None

    return TemperTransferEngine


def register_engine() -> None:
    """Register Temper's engine in vLLM's factory of this process (again: nothing)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, _engine_class())
    except ValueError as error:
        if "already registered" not in str(error):
            raise


def _maybe_stall(bucket: int) -> None:
    setting = os.environ.get(STALL_ENV)
    if setting:
        at, seconds = setting.split(":")
        if bucket == int(at):
            time.sleep(float(seconds))


# -- the sending side (the process that drives the vLLM engine) ----------------------------


@dataclass
class _Progress:
    phase: str = "start_weight_update"
    buckets: int = 0
    bytes: int = 0


class VllmTransfer:
    """Drives the four phases on one vLLM `LLM` (in this process or its own processes)."""

    def __init__(
        self,
        llm: Any,
        *,
        transport: Transport,
        tensor_parallel_size: int,
        tied: bool,
        timeout_s: float,
    ) -> None:
        """Collective with the engine's workers: opens the transfer (`init` phase)."""
        self._llm, self._transport, self._timeout_s = llm, transport, timeout_s
        self._workers = tensor_parallel_size
        init = {"transport": transport, "tied": tied, "timeout_s": timeout_s}
        self._group: Any = None
        if transport == "inline":
            llm.init_weight_transfer_engine({"init_info": init})
            return
        world_size = 1 + tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False)
        init |= {"master_address": "127.0.0.1", "master_port": store.port}
        init["world_size"] = world_size
        deadline = time.monotonic() + timeout_s
        call = _Call(lambda: llm.init_weight_transfer_engine({"init_info": init}))
        self._store = store  # the workers' rendezvous; kept for the engine's life
        try:
            self._group = _gloo_group(_Info(**init), rank=0, is_master=True, store=store)
            self._sender = bucket_stream.StreamSender(self._group, device=torch.device("cpu"))
        except RuntimeError as error:
            raise self._late(_Progress(phase="init_weight_transfer_engine"), error) from error
        call.result(
            deadline,
            on_timeout=lambda: self._late(_Progress(phase="init_weight_transfer_engine"), None),
        )

    def update(self, named: Iterable[tuple[str, torch.Tensor]], *, version: int) -> _Progress:
        """Send every (name, tensor) in vLLM's checkpoint names; `version` becomes vLLM's
        weight version. The tensors must not change until this returns."""
        progress = _Progress()
        deadline = time.monotonic() + self._timeout_s
        self._call(self._llm.start_weight_update, progress, deadline)
        progress.phase = "update_weights"
        if self._transport == "inline":
            for bucket in _buckets(named):
                self._send_inline(bucket)
                _count(progress, bucket)
        else:
            self._stream(_buckets(named), progress, deadline)
        progress.phase = "finish_weight_update"
        self._call(
            lambda: self._llm.finish_weight_update(weight_version=str(version)), progress, deadline
        )
        return progress

    def _send_inline(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        info: dict[str, Any] = {
            "names": [name for name, _ in bucket],
            "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket],
            "shapes": [list(tensor.shape) for _, tensor in bucket],
            "tensors": [tensor for _, tensor in bucket],
        }
        self._llm.update_weights({"update_info": info})

    def _stream(
        self, buckets: Iterable[list[tuple[str, Any]]], progress: _Progress, deadline: float
    ) -> None:
        """Every bucket in one `update_weights` request, while the workers receive them over
        the transfer group, loading bucket k while bucket k+1 arrives (bucket_stream.py)."""
        finished = threading.Event()  # the request ended, or an acknowledgement came
        call = _Call(
            lambda: self._llm.update_weights({"update_info": {"streamed": True}}), wake=finished
        )

        def wait(work: Any) -> None:
            acknowledged = threading.Event()

            def done(_: object) -> None:
                acknowledged.set()
                finished.set()

            work.get_future().add_done_callback(done)
            while not acknowledged.is_set():
                if call.done:
                    if call.error is not None:
                        raise call.error
                    return  # the workers acknowledged every bucket before they returned
                finished.clear()
                if acknowledged.is_set() or call.done:
                    continue
                if not finished.wait(max(0.0, deadline - time.monotonic())):
                    raise self._late(progress, None)

        try:
            self._sender.send(buckets, wait=wait, acked=lambda bucket: _count(progress, bucket))
        except bucket_stream.PeerError as error:
            if call.error is not None:
                raise call.error from error
            raise self._late(progress, error) from error
        call.result(deadline, on_timeout=lambda: self._late(progress, None))

    def _call(self, method: Callable[[], object], progress: _Progress, deadline: float) -> None:
        if self._transport == "inline":
            method()
            return
        _Call(method).result(deadline, on_timeout=lambda: self._late(progress, None))

    def _late(self, progress: _Progress, error: BaseException | None) -> TimeoutError:
        workers = "rank 1" if self._workers == 1 else f"ranks 1-{self._workers}"
        cause = f" ({error})" if error is not None else ""
        return TimeoutError(
            f"vLLM weight transfer: the vLLM worker {workers} of the transfer group did not "
            f"finish phase {progress.phase} within VllmGenerator.Config.sync_timeout_s="
            f"{self._timeout_s:g} s, after {progress.buckets} bucket(s), "
            f"{progress.bytes / 2**20:.1f} MiB sent{cause}; the engine's weights are "
            "incomplete"
        )


class _Call:
    """One request to the engine on a daemon thread of its own (the sender broadcasts
    meanwhile, and a stalled engine must not keep this process from exiting)."""

    def __init__(
        self, method: Callable[[], object], *, wake: threading.Event | None = None
    ) -> None:
        """`wake`: set too when the request ends (for whoever waits on more than it)."""
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._wake = wake
        self._thread = threading.Thread(target=self._run, args=(method,), daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _run(self, method: Callable[[], object]) -> None:
        try:
            method()
        except BaseException as error:
            self.error = error
        finally:
            self._done.set()
            if self._wake is not None:
                self._wake.set()

    def result(self, deadline: float, *, on_timeout: Callable[[], BaseException]) -> None:
        if not self._done.wait(max(0.0, deadline - time.monotonic())):
            raise on_timeout()
        if self.error is not None:
            raise self.error


@dataclass
class _Info:
    transport: str
    tied: bool
    timeout_s: float
    master_address: str
    master_port: int
    world_size: int


def _gloo_group(info: Any, *, rank: int, is_master: bool, store: Any = None) -> Any:
    timeout = datetime.timedelta(seconds=info.timeout_s)
    if store is None:
        store = dist.TCPStore(
            info.master_address, info.master_port, info.world_size, is_master, timeout=timeout
        )
    prefixed = dist.PrefixStore("temper-vllm-transfer", store)
    return dist.ProcessGroupGloo(prefixed, rank, info.world_size, timeout)


def _count(progress: _Progress, bucket: list[tuple[str, torch.Tensor]]) -> None:
    progress.buckets += 1
    progress.bytes += sum(tensor.nbytes for _, tensor in bucket)


def _buckets(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, Any]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        if bucket and size + tensor.nbytes > BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.nbytes
    if bucket:
        yield bucket


# vLLM's workers import this module by its `worker_extension_cls` name before they load the
# model; that import is the one hook that reaches them, so it registers the engine.
with contextlib.suppress(ImportError):  # without vLLM there is nothing to register with
    register_engine()
