"""Reading forward_backward bodies (up to `--max-body-mb`) without holding up other clients.

Starlette's `Request.body()` joins the chunks it received in one copy at the end: about 0.2 s
of the event loop for 250 MB, during which `healthz` and every other request wait.
`read_body` copies each chunk into a buffer of the body's Content-Length (which BodyLimits
has checked) as it arrives instead. The buffer is a numpy array left uninitialized:
`bytearray(n)` zeroes its n bytes at once (0.2 s for 250 MB), and a bytearray grown chunk by
chunk is moved from time to time (130 MB copied at once, measured). A body over OFF_LOOP_BYTES, or
a compressed one (a small body may expand to a GiB), is decoded on a worker thread: decoding
is mostly Python, which hands the GIL back every few ms, and the protobuf parse runs a slice
at a time (proto_slices.py). Smaller bodies decode on the event loop, where a worker thread
would cost more than the decode.
"""

from __future__ import annotations

import asyncio

import numpy as np
from starlette.requests import Request

from temper.server.wire import codec as wire

OFF_LOOP_BYTES = 1 << 20
"""Bodies larger than this are decoded on a worker thread."""


async def read_body(request: Request) -> bytearray | memoryview:
    """The request's body, one short copy per chunk received (module doc)."""
    declared = request.headers.get("content-length", "")
    if not declared.isdigit():  # chunked (the SDK always sends Content-Length)
        grown = bytearray()
        async for chunk in request.stream():
            grown += chunk
        return grown
    # uvicorn delivers exactly Content-Length bytes, or the client disconnected (an error).
    body = memoryview(np.empty(int(declared), dtype=np.uint8))
    filled = 0
    async for chunk in request.stream():
        body[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    return body


async def read_forward_backward(request: Request) -> wire.ForwardBackwardCall:
    """The forward_backward call in `request`'s body (`wire.decode_forward_backward`)."""
    body = await read_body(request)
    encoding = request.headers.get("content-encoding")
    if len(body) <= OFF_LOOP_BYTES and encoding in (None, "", "identity"):
        return wire.decode_forward_backward(body, content_encoding=encoding)
    return await asyncio.to_thread(wire.decode_forward_backward, body, content_encoding=encoding)
