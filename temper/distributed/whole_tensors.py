"""Whole tensors out of weight streams that deliver them as row ranges on several channels.

A consumer that loads only whole tensors by name (vLLM's `load_weights`) cannot take the row
ranges that FSDP trainer ranks send, each its own rows on its own channel
(weight_transfer.py). Received one channel after another, the first channel's rows of every
tensor would wait for the others': a second whole copy. Instead `interleave` draws from the
channels in step, always from the one furthest behind in the model's tensor order (a piece
that is a whole tensor moves no channel forward), so a tensor's rows arrive close together;
every receiver of a channel makes the same choices, since they depend only on what arrived.
`WholeTensors` puts each tensor's rows into a staging tensor of its own and hands the
tensor on the moment its last rows land. What is staged at once is the few tensors whose
rows are still arriving on some channel (plus a tensor larger than a bucket, which comes in
row ranges even from one channel), never the model: `peak_staged_bytes` records it. Given to
the receivers as their destination (`into`), it has a large piece received straight where it
goes (a row range into its staging rows, a whole tensor into a tensor of its own), so nothing
is copied after the receive; a piece packed into a receiver's buffer is copied out.

This module does not receive: the streams are `BucketReceiver.receive()`s, one receiver (one
buffer) per channel, since a channel's received bucket must stay valid while another
channel's is drawn from.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from temper.distributed.weight_pieces import RowCoverage, WeightPiece, WeightRows, as_rows


def interleave(
    streams: Sequence[Iterator[WeightRows]], *, shapes: Mapping[str, tuple[int, ...]]
) -> Iterator[WeightRows]:
    """Every piece of every stream, drawn so that the channels move through the tensors of
    `shapes` (in its order) in step: the next piece comes from the channel whose last row
    range was the earliest tensor (ties: the lower channel). Each stream's pieces must come
    in that order (as `sampler_share` sends them); a piece is valid until the next draw."""
    position = {name: index for index, name in enumerate(shapes)}
    progress = {channel: -1 for channel in range(len(streams))}
    while progress:
        channel = min(progress, key=lambda c: (progress[c], c))
        piece = next(streams[channel], None)
        if piece is None:
            del progress[channel]
            continue
        whole = piece.start == 0 and tuple(piece.value.shape) == tuple(shapes.get(piece.name, ()))
        if not whole:
            progress[channel] = max(progress[channel], position.get(piece.name, -1))
        yield piece


class WholeTensors:
    """Turns a stream of pieces into whole (name, tensor) pairs, each checked against
    `shapes` (every tensor's rows exactly once, or a ValueError)."""

    def __init__(
        self, *, shapes: Mapping[str, tuple[int, ...]], device: torch.device | None = None
    ) -> None:
        """`device`: where tensors received through `into` are allocated (CPU by default)."""
        self._shapes, self._device = shapes, device or torch.device("cpu")
        self._staged: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (tensor, rows due)
        self._placed: set[tuple[str, int]] = set()  # (name, first row) received in place
        self.peak_staged_bytes = 0
        """The most bytes of partly arrived tensors held at once (the last stream's)."""

    def into(
        self, name: str, start: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor | None:
        """A `Destination` for the receivers of the stream being assembled (valid while
        `__call__` draws it): a whole tensor gets a tensor of its own, a row range its rows of
        the tensor's staging tensor; anything else (an unknown name, rows out of range, a
        dtype other than the one staged) stays in the receiver's buffer."""
        full = self._shapes.get(name)
        if full is None or not shape or tuple(shape[1:]) != tuple(full[1:]):
            return None
        if not shape[0] or start < 0 or start + shape[0] > full[0]:
            return None
        if start == 0 and tuple(shape) == tuple(full):
            tensor = torch.empty(full, dtype=dtype, device=self._device)
        else:
            staging, due = self._staged.get(name) or (
                torch.empty(full, dtype=dtype, device=self._device),
                full[0],
            )
            if staging.dtype != dtype:
                return None
            self._staged[name] = (staging, due)
            tensor = staging[start : start + shape[0]]
        self._placed.add((name, start))
        return tensor

    def __call__(self, pieces: Iterable[WeightPiece]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor once its rows are all there. A `WeightRows` piece not received in
        place is a view its receiver reuses, so it is copied (a whole one into a tensor of
        its own); a (name, tensor) pair is handed on as it is."""
        expected = {name: torch.empty(shape, device="meta") for name, shape in self._shapes.items()}
        coverage = RowCoverage(expected)
        self._staged.clear()
        self._placed.clear()
        self.peak_staged_bytes = 0
        for piece in pieces:
            rows = as_rows(piece)
            coverage.check(rows)
            placed = (rows.name, rows.start) in self._placed
            self._placed.discard((rows.name, rows.start))
            shape = self._shapes[rows.name]
            if rows.start == 0 and tuple(rows.value.shape) == tuple(shape):
                copied = isinstance(piece, WeightRows) and not placed
                yield rows.name, rows.value.clone() if copied else rows.value
                continue
            if rows.stop == rows.start:
                continue  # an empty shard
            tensor, due = self._staged.get(rows.name) or (
                torch.empty(shape, dtype=rows.value.dtype, device=rows.value.device),
                shape[0],
            )
            if not placed:
                tensor[rows.start : rows.stop].copy_(rows.value)
            self._staged[rows.name] = (tensor, due - (rows.stop - rows.start))
            held = sum(t.nbytes for t, _ in self._staged.values())
            self.peak_staged_bytes = max(self.peak_staged_bytes, held)
            if not self._staged[rows.name][1]:
                del self._staged[rows.name]
                yield rows.name, tensor
            del piece, rows, tensor
        missing = coverage.missing()
        if missing:
            raise ValueError(f"update_weights: the stream ended without {missing}")
