"""Parse a big protobuf body a slice at a time, so that no one step holds the GIL for long.

upb (the protobuf runtime) holds the GIL for a whole `ParseFromString`: 2 s for 250 MB of
small datums, during which no other thread, the event loop included, runs. Parsing the
concatenation of two serialized messages merges them (repeated fields and maps append, the
last scalar wins), so merging the body's top-level fields in slices of about `slice_bytes`
builds the same message; between slices other threads get their turn. A slice never splits a
field: one field bigger than `slice_bytes` (a datum of many tokens) is merged in one go.

Finding the field boundaries is a Python walk over the top-level fields (about 1 us each);
when the walk meets something that is not a well-formed field, the rest is merged in one go
and upb reports the error.
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.message import Message

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


def merge_in_slices(
    message: Message, body: bytes | bytearray | memoryview, *, slice_bytes: int = 1 << 20
) -> Iterator[None]:
    """Merge `body` into `message`, yielding after each slice (the caller may stop early, e.g.
    once a repeated field is over its limit). Raises protobuf's DecodeError as
    `MergeFromString` does."""
    if len(body) <= slice_bytes:  # one slice: no walk
        message.MergeFromString(body)
        yield
        return
    view = memoryview(body)
    start = position = 0
    while position < len(body):
        try:
            position = _field_end(view, position)
        except ValueError:
            position = len(body)
        if position - start >= slice_bytes or position == len(body):
            message.MergeFromString(view[start:position])
            start = position
            yield


def _field_end(data: memoryview, position: int) -> int:
    """Where the top-level field starting at `position` ends; ValueError if it is cut short
    or of an unknown wire type."""
    key, position = _varint(data, position)
    wire_type = key & 7
    if wire_type == _VARINT:
        _, position = _varint(data, position)
    elif wire_type == _LENGTH_DELIMITED:
        length, position = _varint(data, position)
        position += length
    elif wire_type in (_FIXED64, _FIXED32):
        position += 8 if wire_type == _FIXED64 else 4
    else:
        raise ValueError(f"wire type {wire_type}")
    if position > len(data):
        raise ValueError("field runs past the end")
    return position


def _varint(data: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while shift < 64:
        if position >= len(data):
            raise ValueError("varint runs past the end")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
    raise ValueError("varint longer than 10 bytes")
