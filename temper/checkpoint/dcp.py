"""Train-state checkpoints: model weights and optimizer state with torch.distributed.checkpoint.

A checkpoint is a directory holding DCP's files (`.metadata`, `*.distcp`) and `metadata.json`
(the caller's JSON metadata: step, policy version, LoRA config, ...). The state dicts come from
`torch.distributed.checkpoint.state_dict` keyed by parameter name, so the same code saves and
loads FSDP/TP-sharded models and reshards between world sizes. With `trainable_only` only
parameters that require grad are written (LoRA adapters; the frozen base is not).

What is unusual here:
- The directory is written under a temporary sibling name and renamed into place, so a crash
  never leaves a half-written checkpoint, and an overwritten one is replaced whole.
- No code runs from the checkpoint's files: its index and non-tensor values are read by
  `dcp_reader` (an allow-list of DCP's classes, and weights_only for values).
- Tensor names and shapes are checked against the checkpoint's DCP metadata before anything is
  loaded, so a mismatch is a ValueError naming the tensor and leaves the model as it was.
- An optimizer that has taken no step yet is saved as its param_groups only. DCP's state-dict
  API would otherwise initialize its state with a zero-lr step (AdamW step count 1), which
  changes the next update; resuming from such a checkpoint gives an optimizer with no state.

Several ranks (a sharded model under torchrun): every rank calls save/load with its shards.
Rank 0 owns the staging directory, `metadata.json` and the rename, and tells the others the
staging path and any error, so all ranks raise together and return only once the checkpoint
is in place. Checkpoints reshard: N ranks save, M ranks (or one process) load. Without a
process group DCP runs with `no_dist`.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from temper.checkpoint.atomic import check_free, staged_directory
from temper.checkpoint.dcp_reader import SafeLoadPlanner, SafeReader, read_dcp_index
from temper.distributed.world import trainer_world

METADATA_FILE = "metadata.json"
DCP_METADATA_FILE = ".metadata"
_MODEL = "model"
_OPTIMIZER = "optim"
# How many missing tensor names an error message lists before summarizing.
_MAX_NAMES_SHOWN = 5


def save_train_state(
    directory: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    metadata: Mapping[str, Any],
    trainable_only: bool,
    overwrite: bool = False,
) -> Path:
    """Write the model (and optimizer) state and `metadata` to `directory`; returns its path."""
    metadata_text = _metadata_json(metadata)
    directory = check_free(directory, overwrite=overwrite)
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    state: dict[str, Any] = {_MODEL: get_model_state_dict(model, options=options)}
    if optimizer is not None:
        state[_OPTIMIZER] = _optimizer_state_to_save(model, optimizer, options=options)

    if not _no_dist():
        _save_on_all_ranks(directory, state=state, metadata_text=metadata_text)
        return directory
    with staged_directory(directory) as staging, _single_process_quiet(), _plain_errors():
        torch_dcp.save(state, storage_writer=torch_dcp.FileSystemWriter(staging), no_dist=True)
        _write_synced(staging / METADATA_FILE, metadata_text)
    return directory


def _save_on_all_ranks(directory: Path, *, state: dict[str, Any], metadata_text: str) -> None:
    """Rank 0 stages and renames; every rank writes its shards; errors reach all ranks, and no
    rank returns before the checkpoint is in place."""
    if trainer_world().rank != 0:
        staging = Path(_from_rank0(None, None))
        try:
            with _plain_errors():
                torch_dcp.save(
                    state,
                    storage_writer=torch_dcp.FileSystemWriter(staging),
                    process_group=trainer_world().group,
                )
        finally:
            _from_rank0(None, None)
        return
    sent_staging = False
    try:
        with staged_directory(directory) as staging:
            _from_rank0(str(staging), None)
            sent_staging = True
            with _plain_errors():
                torch_dcp.save(
                    state,
                    storage_writer=torch_dcp.FileSystemWriter(staging),
                    process_group=trainer_world().group,
                )
            _write_synced(staging / METADATA_FILE, metadata_text)
    except Exception as error:
        if not sent_staging:
            _from_rank0(None, error)
        _from_rank0(None, error)
    _from_rank0(None, None)


def _from_rank0(value: str | None, error: BaseException | None) -> str | None:
    """Rank 0's `value`, on every rank; rank 0's error raised on every rank."""
    message = [value, None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(message, group=trainer_world().group, group_src=0)
    if error is not None:
        raise error
    if message[1] is not None:
        raise OSError(f"rank 0 could not write the checkpoint: {message[1]}")
    return message[0]


def load_train_state(
    directory: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainable_only: bool,
) -> dict[str, Any]:
    """Load a checkpoint into `model` (and `optimizer`, unless None); returns its metadata.

    With trainable_only only the parameters that require grad are read; the others keep
    their values. Loading restores the optimizer's param_groups (lr, betas, ...) as saved.
    """
    directory = Path(directory)
    metadata = read_train_state_metadata(directory)
    index = read_dcp_index(directory / DCP_METADATA_FILE)
    _check_files(directory, index.storage_data)
    saved = index.state_dict_metadata
    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    state: dict[str, Any] = {_MODEL: get_model_state_dict(model, options=options)}
    _check_tensors(state, saved=saved, directory=directory)
    if optimizer is not None:
        state[_OPTIMIZER] = _optimizer_state_to_load(
            model, optimizer, options=options, saved=saved, directory=directory
        )

    with _single_process_quiet(), _plain_errors():
        torch_dcp.load(
            state,
            storage_reader=SafeReader(directory),
            planner=SafeLoadPlanner(),
            no_dist=_no_dist(),
            process_group=None if _no_dist() else trainer_world().group,
        )
    set_model_state_dict(model, state[_MODEL], options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state[_OPTIMIZER], options=options)
    return metadata


def _check_files(directory: Path, storage_data: Mapping[Any, Any]) -> None:
    """Every byte range the checkpoint's index names lies inside an existing file.

    DCP copies each tensor into the model as it reads it, so a shard file that is missing or
    cut short (an interrupted copy) would leave the model half loaded; checked first, it
    changes nothing."""
    ends: dict[str, int] = {}
    for item in storage_data.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {directory} is incomplete: {name} is missing")
        if (size := path.stat().st_size) < end:
            raise ValueError(
                f"checkpoint {directory} is damaged: {name} has {size} bytes, its index needs "
                f"{end} (a copy cut short?)"
            )


def read_train_state_metadata(directory: str | Path) -> dict[str, Any]:
    """The metadata a train-state checkpoint was saved with."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"train-state checkpoint directory {directory} does not exist")
    missing = [
        name for name in (METADATA_FILE, DCP_METADATA_FILE) if not (directory / name).is_file()
    ]
    if missing:
        raise FileNotFoundError(
            f"{directory} is not a train-state checkpoint: it lacks {', '.join(missing)}"
        )
    return json.loads((directory / METADATA_FILE).read_text())


def _metadata_json(metadata: Mapping[str, Any]) -> str:
    try:
        return json.dumps(dict(metadata), indent=2) + "\n"
    except TypeError as error:
        raise TypeError(
            f"metadata must be JSON-serializable (str, int, float, bool, None and lists and "
            f"dicts of them), got {error}"
        ) from error


def _optimizer_state_to_save(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, options: StateDictOptions
) -> dict[str, Any]:
    had_state = bool(optimizer.state)
    state_dict = get_optimizer_state_dict(model, optimizer, options=options)
    if not had_state:
        # Undo the zero-lr initialization step DCP took (see the module docstring).
        optimizer.state.clear()
        state_dict["state"] = {}
    return state_dict


def _optimizer_state_to_load(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    options: StateDictOptions,
    saved: Mapping[str, Any],
    directory: Path,
) -> dict[str, Any]:
    if not any(key.startswith(f"{_OPTIMIZER}.") for key in saved):
        raise ValueError(
            f"{directory} holds no optimizer state (it was saved with optimizer=None); "
            "load it with optimizer=None"
        )
    had_state = bool(optimizer.state)
    # For an optimizer with no state yet this takes DCP's zero-lr initialization step, which
    # creates the state tensors the checkpoint is loaded into.
    state_dict = get_optimizer_state_dict(model, optimizer, options=options)
    if not any(key.startswith(f"{_OPTIMIZER}.state.") for key in saved):
        state_dict["state"] = {}  # saved before its first step: load param_groups, no state
    try:
        _check_tensors({_OPTIMIZER: state_dict}, saved=saved, directory=directory)
    except ValueError:
        if not had_state:
            optimizer.state.clear()
        raise
    return state_dict


def _check_tensors(state: Mapping[str, Any], *, saved: Mapping[str, Any], directory: Path) -> None:
    """Every tensor to load exists in the checkpoint with the same (global) shape."""
    missing = []
    for key, tensor in _tensor_leaves(state):
        entry = saved.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            missing.append(key)
        elif tuple(entry.size) != tuple(tensor.shape):
            raise ValueError(
                f"{directory}: checkpoint tensor {key!r} has shape {tuple(entry.size)} but the "
                f"model expects {tuple(tensor.shape)}"
            )
    if missing:
        shown = ", ".join(repr(key) for key in missing[:_MAX_NAMES_SHOWN])
        more = (
            f" and {len(missing) - _MAX_NAMES_SHOWN} more"
            if len(missing) > _MAX_NAMES_SHOWN
            else ""
        )
        hint = ""
        if any(key.startswith(f"{_MODEL}.") for key in missing):
            hint = (
                "; a checkpoint saved with trainable_only=True holds only the parameters that "
                "required grad, so load it with trainable_only=True"
            )
        raise ValueError(f"{directory}: checkpoint lacks tensors {shown}{more}{hint}")


def _tensor_leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(flat key, tensor) pairs, keyed the way DCP flattens nested state dicts."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _tensor_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list | tuple):
        for index, value in enumerate(tree):
            yield from _tensor_leaves(value, f"{prefix}.{index}")


def _no_dist() -> bool:
    """One process writes and reads alone (also a one-rank trainer beside generator ranks)."""
    return not (dist.is_available() and dist.is_initialized()) or trainer_world().size == 1


@contextlib.contextmanager
def _plain_errors() -> Iterator[None]:
    """Re-raise DCP's CheckpointException as the error behind it (e.g. FileNotFoundError for
    a missing shard file): CheckpointException derives from BaseException, so `except
    Exception` handlers (a server's, a worker's) would let it through."""
    try:
        yield
    except CheckpointException as error:
        causes = [cause for cause, _ in error.failures.values() if isinstance(cause, Exception)]
        if not causes:
            raise
        raise causes[0] from None


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's per-call warning that it assumes one process; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        yield


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
