"""A body merged a slice at a time is the message ParseFromString builds, errors included."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from temper.server.wire.proto_slices import merge_in_slices


def request_body(num_datums: int) -> bytes:
    message = pb.ForwardBackwardRequest(model_id="m:train:0", seq_id=3, loss_fn="cross_entropy")
    for index in range(num_datums):
        tokens = np.full(index % 7 + 1, index, dtype=np.int32).tobytes()
        message.data.add().model_input.add().encoded_text.tokens = tokens
    message.loss_fn_config["clip"] = 0.5
    # A second serialization appended: its scalars win, as in a whole parse.
    return message.SerializeToString() + pb.ForwardBackwardRequest(seq_id=9).SerializeToString()


def merged(body: bytes, *, slice_bytes: int) -> tuple[pb.ForwardBackwardRequest, int]:
    message = pb.ForwardBackwardRequest()
    num_slices = sum(1 for _ in merge_in_slices(message, body, slice_bytes=slice_bytes))
    return message, num_slices


@pytest.mark.parametrize("slice_bytes", [1, 1000, 1 << 20])
def test_slices_build_the_whole_message(slice_bytes):
    body = request_body(3000)
    expected = pb.ForwardBackwardRequest()
    expected.ParseFromString(body)
    message, num_slices = merged(body, slice_bytes=slice_bytes)
    assert message == expected and message.seq_id == 9 and len(message.data) == 3000
    # model_id, seq_id, loss_fn, the datums, the config entry, the second seq_id
    num_fields = 3 + 3000 + 1 + 1
    assert num_slices == {1: num_fields, 1000: pytest.approx(len(body) / 1000, rel=0.1)}.get(
        slice_bytes, 1
    )


@pytest.mark.parametrize("tail", [b"\xff\xff", b"\x0a\x40abc", b"\x0f", b"\x08" + b"\xff" * 11])
def test_a_malformed_tail_fails_as_a_whole_parse_does(tail):
    body = request_body(300) + tail
    with pytest.raises(DecodeError):
        pb.ForwardBackwardRequest().ParseFromString(body)
    with pytest.raises(DecodeError):
        merged(body, slice_bytes=100)


def test_the_caller_may_stop_early():
    body = request_body(3000)
    message = pb.ForwardBackwardRequest()
    for _ in merge_in_slices(message, body, slice_bytes=1000):
        if len(message.data) > 100:
            break
    assert 100 < len(message.data) < 3000
