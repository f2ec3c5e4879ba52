"""Checkpoint files crafted to run code when unpickled, for the tests of every load path.

Each payload, if it ran, would create its `marker` file: a test asserts the load is refused
with an error naming the checkpoint and that the marker never appears.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from temper.checkpoint.dcp import DCP_METADATA_FILE, METADATA_FILE


class RunsCode:
    """Unpickles into a call of `os.system` (what an attacker's `__reduce__` would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_index(checkpoint: Path, *, marker: Path) -> None:
    """Replace the checkpoint's DCP index (`.metadata`) with a pickle that runs code."""
    (checkpoint / DCP_METADATA_FILE).write_bytes(pickle.dumps(RunsCode(marker)))


def write_with_planted_value(
    checkpoint: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    metadata: dict,
    marker: Path,
) -> None:
    """A complete checkpoint whose optimizer learning rate is a value that runs code when
    DCP reads it back (DCP stores non-tensor values as torch.save pickles)."""
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    optimizer_state["param_groups"][0]["lr"] = RunsCode(marker)
    state = {"model": get_model_state_dict(model), "optim": optimizer_state}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's 'assuming a single process'
        torch_dcp.save(state, storage_writer=torch_dcp.FileSystemWriter(checkpoint), no_dist=True)
    (checkpoint / METADATA_FILE).write_text(json.dumps(metadata))
