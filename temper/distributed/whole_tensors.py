"""Whole tensors out of weight streams that deliver them as row ranges on several channels.

A consumer that loads only whole tensors by name (vLLM's `load_weights`) cannot take the row
ranges that FSDP trainer ranks send, each its own rows on its own channel
(weight_transfer.py). Received one channel after another, the first channel's rows of every
tensor would wait for the others': a second whole copy. Instead `interleave` draws from the
channels in step, always from the one furthest behind in the model's tensor order (a piece
that is a whole tensor moves no channel forward), so a tensor's rows arrive close together;
every receiver of a channel makes the same choices, since they depend only on what arrived.
`WholeTensors` copies each tensor's rows into a staging tensor of its own and hands the
tensor on the moment its last rows land. What is staged at once is the few tensors whose
rows are still arriving on some channel (plus a tensor larger than a bucket, which comes in
row ranges even from one channel), never the model: `peak_staged_bytes` records it.

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

    def __init__(self, *, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._shapes = shapes
        self.peak_staged_bytes = 0
        """The most bytes of partly arrived tensors held at once (the last stream's)."""

    def __call__(self, pieces: Iterable[WeightPiece]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor once its rows are all there. A `WeightRows` piece is a view its
        receiver reuses, so it is copied (a whole one into a tensor of its own); a
        (name, tensor) pair is handed on as it is."""
        expected = {name: torch.empty(shape, device="meta") for name, shape in self._shapes.items()}
        coverage = RowCoverage(expected)
        staged: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (tensor, rows still due)
        self.peak_staged_bytes = 0
        for piece in pieces:
            rows = as_rows(piece)
            coverage.check(rows)
            shape = self._shapes[rows.name]
            if rows.start == 0 and tuple(rows.value.shape) == tuple(shape):
                yield rows.name, rows.value.clone() if isinstance(piece, WeightRows) else rows.value
                continue
            if rows.stop == rows.start:
                continue  # an empty shard
            tensor, due = staged.get(rows.name) or (
                torch.empty(shape, dtype=rows.value.dtype, device=rows.value.device),
                shape[0],
            )
            tensor[rows.start : rows.stop].copy_(rows.value)
            staged[rows.name] = (tensor, due - (rows.stop - rows.start))
            held = sum(t.nbytes for t, _ in staged.values())
            self.peak_staged_bytes = max(self.peak_staged_bytes, held)
            if not staged[rows.name][1]:
                del staged[rows.name]
                yield rows.name, tensor
            del piece, rows, tensor
        missing = coverage.missing()
        if missing:
            raise ValueError(f"update_weights: the stream ended without {missing}")
