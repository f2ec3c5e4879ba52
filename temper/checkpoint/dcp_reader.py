"""Reading DCP checkpoints without running code from them.

torch.distributed.checkpoint keeps a checkpoint's index (`.metadata`) as a pickle, and its
non-tensor values (an optimizer's lr, betas, ...) as `torch.load(weights_only=False)` blobs.
Both run whatever a crafted file asks for when they are read. Checkpoints come from a storage
directory that a team shares, or from a path a client names, so their bytes are not trusted:

- The index is read with an unpickler that builds only the classes DCP's metadata is made of
  (the dataclasses of `torch.distributed.checkpoint.metadata`, DCP's file entries, torch
  sizes, dtypes and layouts, paths). Anything else is refused before it is built.
- Non-tensor values are read with `torch.load(weights_only=True)`, which admits tensors and
  plain Python values only.
- Every file the index names is a plain file name inside the checkpoint directory.

This reads the checkpoints DCP writes, whenever they were written, byte for byte as DCP
does: an allow-list of classes, not a second format, so nothing has to be rewritten. A digest
recorded at save time would refuse every checkpoint written before it, and any copied in from
elsewhere.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem


class UnsafeCheckpoint(ValueError):
    """A checkpoint file asks to build something a checkpoint never holds."""


_METADATA_CLASSES = {
    (dcp_metadata.__name__, name): getattr(dcp_metadata, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
}
_ALLOWED = {
    **_METADATA_CLASSES,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): PosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("collections", "OrderedDict"): dict,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata classes and torch dtypes; refuses every other global."""

    def __init__(self, file: io.BufferedIOBase, *, source: Path) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(
            f"checkpoint {self._source.parent} is refused: its {self._source.name} asks to "
            f"build {module}.{name}, which a DCP checkpoint index never holds (a crafted or "
            "foreign file; nothing of it was run)"
        )


def read_dcp_index(path: Path) -> dcp_metadata.Metadata:
    """The DCP index at `path` (a `.metadata` file), built by the restricted unpickler."""
    with path.open("rb") as handle:
        try:
            index = _MetadataUnpickler(handle, source=path).load()
        except UnsafeCheckpoint:
            raise
        except Exception as error:
            raise ValueError(
                f"checkpoint {path.parent} is damaged: its {path.name} cannot be read "
                f"({type(error).__name__}: {error})"
            ) from None
    if not isinstance(index, dcp_metadata.Metadata):
        raise UnsafeCheckpoint(
            f"checkpoint {path.parent} is refused: its {path.name} holds a "
            f"{type(index).__name__}, not a DCP index"
        )
    _check_file_names(index, directory=path.parent)
    return index


def _check_file_names(index: dcp_metadata.Metadata, *, directory: Path) -> None:
    """Every file the index names is a plain name inside the checkpoint directory."""
    for entry in (index.storage_data or {}).values():
        name = getattr(entry, "relative_path", None)
        if not isinstance(name, str) or not name or Path(name).name != name or name in ("..", "."):
            raise UnsafeCheckpoint(
                f"checkpoint {directory} is refused: its index names the file {name!r}, "
                "which is not a file inside the checkpoint directory"
            )


class SafeReader(FileSystemReader):
    """A FileSystemReader whose index is read by `read_dcp_index`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = Path(self.path) / Path(self._get_metadata_path(kwargs.get("rank"))).name
        index = read_dcp_index(path)
        if getattr(index, "storage_meta", None) is None:
            index.storage_meta = dcp_metadata.StorageMeta()
        index.storage_meta.load_id = self.load_id
        return index


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpoint(
                f"checkpoint value {fqn!r} is refused: it is not a plain value or tensor "
                f"({str(error).splitlines()[0]})"
            ) from None
        # What DefaultLoadPlanner.load_bytes does with the value it loads.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
