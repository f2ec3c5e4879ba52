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
them, and vLLM's layerwise reload for the others. Its transports, chosen from where vLLM
runs (the rule: generator/vllm_transports.py; `VllmGenerator.Config.transport` forces one):
- 'inline' (vLLM in this process): one `update_weights` request per bucket, its tensors in
  the request itself (no copy before vLLM's own into its weights);
- 'ipc' (vLLM's own processes, every worker on the sender's device: one GPU, or CPU): one
  `update_weights` request per bucket, carrying a descriptor in plain data (names, shapes,
  offsets, and the handle of a shared buffer: CUDA IPC on a GPU, a shared-memory file on
  CPU; distributed/shared_buckets.py). The worker maps the buffer without a copy and loads
  views of it; the request's return acknowledges the bucket, and the sender fills the other
  of two buffers meanwhile. vLLM's layerwise reload keeps the tensors of a layer not yet
  complete: the worker copies those (`_release_shared`), since the buffer is refilled;
- 'gloo' / 'nccl' (vLLM's own processes, on other devices; gloo also where nothing else
  fits): the sender (this process, rank 0) and every vLLM worker (ranks 1..tp) form a group
  of their own, and one `update_weights` request streams every bucket over it
  (distributed/bucket_stream.py): a worker loads bucket k while bucket k+1 arrives, and
  acknowledges each, so no more than two are in flight and the deadline knows how far the
  load got. 'gloo' stages the buckets in host memory; 'nccl' sends them device to device
  over an NCCL group and keeps headers and acknowledgements on a gloo group beside it (the
  same stream code: gloo with gloo is its CPU twin).

Every update has a deadline (`timeout_s`): a worker that stalls mid-transfer raises a
`TimeoutError` naming the transport, the worker ranks, the phase and how far the transfer
got, within the deadline; one that dies closes its connection, and the update raises a
`RuntimeError` saying so at once. In one process there is no peer to wait on, so the inline
transport has none.
vLLM's processes end with the process that drives them, even if it is killed: importing this
module in a worker starts that watch (vllm_owner.py).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from temper.distributed import bucket_stream
from temper.distributed.shared_buckets import MappedSlots, SharedSlots
from temper.generator.vllm_owner import watch_owner_if_announced
from temper.generator.vllm_reload import InPlaceReload
from temper.generator.vllm_transports import Transport

ENGINE_NAME = "temper"
"""The name of Temper's engine in vLLM's WeightTransferEngineFactory."""
BUCKET_BYTES = 64 * 2**20
"""Bytes of weights per `update_weights` request (a larger tensor goes alone)."""
FAULT_ENV = "TEMPER_TEST_VLLM_TRANSFER_FAULT"
"""Tests only: 'N:SECONDS' makes every worker sleep SECONDS before loading bucket N (counted
from 1 in each update), to stand for a stalled peer; 'N:exit' ends the worker there at once
(`os._exit`, no goodbye on any connection), as if it were killed."""


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


class _Receiving:
    """The worker side's behaviour, mixed into `TemperTransferEngine` (whose base class is
    vLLM's, so it is defined on first use): receives buckets (inline, shared, or streamed over
    gloo/NCCL) into the model (vllm_reload.py)."""

    # Set by vLLM's WeightTransferEngine.__init__, which also gives `parse_update_info`.
    model: Any
    model_config: Any
    device: torch.device

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.init_info: Any = None
        self.group: Any = None  # gloo: the stream; nccl: its headers and acknowledgements
        self.data_group: Any = None  # nccl: the stream's bytes
        self.mapped = MappedSlots()  # ipc: the sender's shared buffers
        self.buckets = 0
        self.reload: InPlaceReload | None = None

    def init_transfer_engine(self, init_info: Any) -> None:
        self.init_info = init_info
        if init_info.transport in ("gloo", "nccl"):
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = 1 + get_tensor_model_parallel_rank()
            store = _worker_store(init_info)
            self.group = _gloo_group(init_info, rank=rank, store=store)
            if init_info.transport == "nccl":
                self.data_group = _nccl_group(init_info, rank=rank, store=store, device=self.device)

    def start_weight_update(self) -> None:
        self.buckets = 0
        self.reload = InPlaceReload(self.model, model_config=self.model_config)
        self.reload.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base class synchronizes an accelerator, which a CPU worker has not.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: Any) -> None:
        assert self.reload is not None
        if update_info.streamed:
            # vLLM keeps the tensors of a layer not yet complete: each bucket has its
            # own buffer, freed once vLLM lets go of it.
            nccl = self.data_group is not None
            self.buckets += bucket_stream.receive(
                self.data_group if nccl else self.group,
                device=self.device if nccl else torch.device("cpu"),
                load=self.reload.load,
                before_load=lambda number: _maybe_fault(self.buckets + number),
                control=self.group if nccl else None,
            )
            return
        self.buckets += 1
        _maybe_fault(self.buckets)
        if update_info.shared is not None:
            self.mapped.load(
                update_info.shared,
                device=self.device,
                load=self.reload.load,
                release=_release_shared,
            )
            return
        assert update_info.tensors is not None
        self.reload.load(zip(update_info.names, update_info.tensors, strict=True))

    def finish_weight_update(self) -> None:
        assert self.reload is not None
        self.reload.finish()
        self.reload = None

    def shutdown(self) -> None:
        self.group = self.data_group = None
        self.mapped.close()


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
        streamed: bool = False  # gloo/nccl transport: every bucket, streamed (bucket_stream.py)
        shared: dict[str, Any] | None = None  # ipc transport: one bucket's descriptor

    class TemperTransferEngine(_Receiving, WeightTransferEngine[InitInfo, UpdateInfo]):
        """Receives buckets into the model (`_Receiving`)."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo

    return TemperTransferEngine


def register_engine() -> None:
    """Register Temper's engine in vLLM's factory of this process (again: nothing)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, _engine_class())
    except ValueError as error:
        if "already registered" not in str(error):
            raise


def _maybe_fault(bucket: int) -> None:
    setting = os.environ.get(FAULT_ENV)
    if setting:
        at, fault = setting.split(":")
        if bucket == int(at):
            if fault == "exit":
                os._exit(17)
            time.sleep(float(fault))


def _release_shared(buffer: torch.Tensor) -> None:
    """Copy the tensors vLLM's layerwise reload keeps of a shared bucket (the weights of a
    layer not yet complete, replayed once the layer is), so that the sender can refill the
    buffer. A layer completed by the bucket kept nothing: only a layer split across buckets
    costs a copy, of its part in this one."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    shared = buffer.untyped_storage().data_ptr()
    for info in list(LAYERWISE_INFO.values()):
        for _, arguments in info.loaded_weights:
            for key, value in arguments.arguments.items():
                if isinstance(value, torch.Tensor) and (
                    value.untyped_storage().data_ptr() == shared
                ):
                    arguments.arguments[key] = value.clone()


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
        timeout_s: float,
        device: torch.device,
    ) -> None:
        """Collective with the engine's workers: opens the transfer (`init` phase). `device`:
        where the sender's buffers live (ipc: the shared ones; nccl: the stream's)."""
        self._llm, self._transport, self._timeout_s = llm, transport, timeout_s
        self._workers = tensor_parallel_size
        init = {"transport": transport, "timeout_s": timeout_s}
        self._group: Any = None
        if transport in ("inline", "ipc"):
            if transport == "ipc":
                self._slots = SharedSlots(device=device, min_bytes=BUCKET_BYTES)
            call = _Call(lambda: llm.init_weight_transfer_engine({"init_info": init}))
            call.result(
                time.monotonic() + timeout_s,
                on_timeout=lambda: self._late(_Progress(phase="init_weight_transfer_engine"), None),
            )
            return
        world_size = 1 + tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False)
        init |= {"master_address": "127.0.0.1", "master_port": store.port}
        init["world_size"] = world_size
        deadline = time.monotonic() + timeout_s
        call = _Call(lambda: llm.init_weight_transfer_engine({"init_info": init}))
        self._store = store  # the workers' rendezvous; kept for the engine's life
        try:
            self._group = _gloo_group(_Info(**init), rank=0, store=store)
            if transport == "nccl":
                data = _nccl_group(_Info(**init), rank=0, store=store, device=device)
                self._sender = bucket_stream.StreamSender(data, device=device, control=self._group)
            else:
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
        elif self._transport == "ipc":
            self._share(_buckets(named), progress, deadline)
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

    def _share(
        self, buckets: Iterable[list[tuple[str, Any]]], progress: _Progress, deadline: float
    ) -> None:
        """One request per bucket, its bytes in a shared buffer: the next bucket is copied
        into the other buffer while the workers load this one (the request returns once
        they have)."""
        pending: tuple[_Call, list[tuple[str, Any]]] | None = None
        try:
            for bucket in buckets:
                info = {"shared": self._slots.fill(bucket)}
                if pending is not None:
                    waiting, pending = pending, None
                    self._acknowledged(*waiting, progress, deadline)
                pending = (
                    _Call(lambda info=info: self._llm.update_weights({"update_info": info})),
                    bucket,
                )
        finally:  # a bucket that failed to draw leaves the one in flight to finish first
            if pending is not None:
                self._acknowledged(*pending, progress, deadline)

    def _acknowledged(
        self, call: _Call, bucket: list[tuple[str, Any]], progress: _Progress, deadline: float
    ) -> None:
        self._result(call, progress, deadline)
        _count(progress, bucket)

    def _result(self, call: _Call, progress: _Progress, deadline: float) -> None:
        """Wait for one request to vLLM's workers: in time, or an error saying what failed."""
        try:
            call.result(deadline, on_timeout=lambda: self._late(progress, None))
        except TimeoutError:
            raise
        except Exception as error:
            raise self._failed(progress, error) from error

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
            raise self._stopped(progress, error) from error
        call.result(deadline, on_timeout=lambda: self._late(progress, None))

    def _call(self, method: Callable[[], object], progress: _Progress, deadline: float) -> None:
        if self._transport == "inline":
            method()
            return
        self._result(_Call(method), progress, deadline)

    def _late(self, progress: _Progress, error: BaseException | None) -> TimeoutError:
        cause = f" ({error})" if error is not None else ""
        return TimeoutError(
            f"vLLM weight transfer ({self._transport} transport): the vLLM worker "
            f"{self._ranks()} of the transfer group did not finish phase {progress.phase} "
            f"within VllmGenerator.Config.sync_timeout_s={self._timeout_s:g} s, "
            f"{self._sent(progress)}{cause}; the engine's weights are "
            "incomplete"
        )

    def _stopped(self, progress: _Progress, error: BaseException) -> Exception:
        """A collective of the stream failed: a worker died (its connection closed), or the
        group's own timeout passed (a stall)."""
        if "timeout" in str(error).lower() or "timed out" in str(error).lower():
            return self._late(progress, error)
        cause = str(error).strip().splitlines()[0]
        who = "the vLLM worker rank 1" if self._workers == 1 else "a vLLM worker"
        return RuntimeError(
            f"vLLM weight transfer ({self._transport} transport): {who} of the transfer group "
            f"({self._ranks()}) stopped "
            f"(its connection closed) in phase {progress.phase}, "
            f"{self._sent(progress)} ({cause}); the engine's weights are incomplete"
        )

    def _failed(self, progress: _Progress, error: BaseException) -> Exception:
        """A request to vLLM's workers failed: vLLM cancels it when a worker died (its
        executor failed), or a worker raised."""
        cause = str(error).strip().splitlines()[0]
        died = "cancelled" in cause or "Executor failed" in cause
        what = "stopped (vLLM's executor lost it)" if died else "failed"
        return RuntimeError(
            f"vLLM weight transfer ({self._transport} transport): the vLLM worker "
            f"{self._ranks()} of the transfer group {what} in phase {progress.phase}, "
            f"{self._sent(progress)} ({cause}); the engine's weights are incomplete"
        )

    def _ranks(self) -> str:
        return "rank 1" if self._workers == 1 else f"ranks 1-{self._workers}"

    @staticmethod
    def _sent(progress: _Progress) -> str:
        return f"after {progress.buckets} bucket(s), {progress.bytes / 2**20:.1f} MiB sent"


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
    timeout_s: float
    master_address: str
    master_port: int
    world_size: int


def _worker_store(info: Any) -> Any:
    """A worker's client of the sender's rendezvous store."""
    timeout = datetime.timedelta(seconds=info.timeout_s)
    return dist.TCPStore(
        info.master_address, info.master_port, info.world_size, False, timeout=timeout
    )


def _gloo_group(info: Any, *, rank: int, store: Any) -> Any:
    timeout = datetime.timedelta(seconds=info.timeout_s)
    prefixed = dist.PrefixStore("temper-vllm-transfer", store)
    return dist.ProcessGroupGloo(prefixed, rank, info.world_size, timeout)


def _nccl_group(info: Any, *, rank: int, store: Any, device: torch.device) -> Any:
    """The nccl transport's data group (its own prefix on the same store), bound to `device`."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=info.timeout_s)
    torch.cuda.set_device(device)
    prefixed = dist.PrefixStore("temper-vllm-transfer-nccl", store)
    return dist.ProcessGroupNCCL(prefixed, rank, info.world_size, options)


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
# model; that import is the one hook that reaches them, so it registers the engine and, in a
# worker of an engine in its own processes, watches the engine's owner (vllm_owner.py).
with contextlib.suppress(ImportError):  # without vLLM there is nothing to register with
    register_engine()
watch_owner_if_announced()
