"""Tinker wire types <-> `temper.api.types`, at the HTTP boundary.

The schema is the `tinker` SDK's own: its pydantic request models for the JSON bodies and its
generated protobuf module (`tinker.proto.tinker_public_pb2`) for the binary ones, imported
rather than copied. Forward/backward requests and the results of forward/backward and sample
are protobuf; every byte array is a raw little-endian numpy buffer.

Conventions kept here (they are what the SDK and tinker-cookbook rely on): token ids are int32
on the wire; 2-D loss inputs ([T, K] top-K targets and weights) may arrive as sparse CSR;
per-datum outputs travel as an `ArrayRecord` whose BatchedTensors hold the datums back to back
with int64 byte offsets (one record per run of datums with the same trailing shape, e.g. K);
metric keys are `name:reduction`; prompt logprobs are float32 with NaN where not scored; an
empty top-k cell is token 0 with logprob -99999.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tinker import types as tinker_types
from tinker.proto import tinker_public_pb2 as pb

from temper.api.prompt_targets import PromptTargets
from temper.api.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ModelInput,
    SampleResponse,
    SamplingParams,
    TensorData,
    TopkLogprobs,
    unsupported_chunk,
)
from temper.server.http.errors import BadRequest
from temper.server.state.provenance import Provenance, Span
from temper.server.wire.proto_slices import merge_in_slices
from temper.server.wire.targets import decode_targets, encode_target_logprobs

_TENSOR_DTYPES = {
    pb.DTYPE_FLOAT32: (np.dtype(np.float32), "float32"),
    pb.DTYPE_INT64: (np.dtype(np.int64), "int64"),
    pb.DTYPE_INT32: (np.dtype(np.int32), "int64"),
}
_OUTPUT_DTYPES = {"float32": (np.float32, pb.DTYPE_FLOAT32), "int64": (np.int64, pb.DTYPE_INT64)}
_EMPTY_TOPK = (0, -99999.0)
MAX_BODY_BYTES = 1 << 30
"""Largest forward_backward body after zstd decompression (a small body may expand hugely)."""
MAX_DATUMS = 65536
"""Most datums one forward_backward request may carry (the SDK sends at most 1024 a request)."""
MAX_STOPS = 64
"""Most stop strings, or stop token ids, a sample request may give."""
MAX_STOP_CHARS = 1024
"""Longest stop string."""
MAX_SPARSE_VALUES = 1 << 22
"""Most values a sparse CSR loss input may expand to: its shape is not bounded by the body's
size. Loss inputs hold one value per token ([T], T <= max_seq_len) or, for top-K
cross_entropy, K per token ([T, K]; e.g. 32k tokens x K=20 is 640k values)."""


@dataclass(frozen=True, kw_only=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]
    provenance: tuple[Provenance | None, ...]
    """Per datum: its provenance spans, None where it has none."""


@dataclass(frozen=True, kw_only=True)
class SampleCall:
    prompt: ModelInput
    num_samples: int
    params: SamplingParams
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    topk_sample_logprobs: int
    prompt_logprobs_last_n: int | None
    record_stability_info: bool
    target_prompt_logprobs: PromptTargets | None = None
    target_sparse: bool = False
    """The targets came as sparse CSR, and their answer goes back in the same layout."""


# -- forward_backward: protobuf in, protobuf out ----------------------------------------------


def decode_forward_backward(
    body: bytes | bytearray | memoryview, *, content_encoding: str | None
) -> ForwardBackwardCall:
    """The call a forward_backward body asks for. Safe to run on a worker thread: the body is
    parsed a slice at a time (proto_slices.py), so the event loop gets its turns."""
    if content_encoding == "zstd":
        body = _decompressed(body)
    elif content_encoding not in (None, "", "identity"):
        raise BadRequest(f"unsupported Content-Encoding {content_encoding!r}; use zstd or none")
    message = _parsed(body)
    if not message.model_id:
        raise BadRequest("forward_backward: model_id is missing")
    config: dict[str, float | str] = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = [_datum(datum, index=index) for index, datum in enumerate(message.data)]
    provenance = tuple(_provenance(datum, index=index) for index, datum in enumerate(message.data))
    return ForwardBackwardCall(
        model_id=message.model_id,
        seq_id=message.seq_id,
        loss_fn=message.loss_fn,
        loss_fn_config=config,
        forward_only=message.forward_only,
        data=data,
        provenance=provenance,
    )


def _parsed(body: bytes | bytearray | memoryview) -> pb.ForwardBackwardRequest:
    message = pb.ForwardBackwardRequest()
    try:
        for _ in merge_in_slices(message, body):
            if len(message.data) > MAX_DATUMS:
                break
    except Exception as error:  # protobuf's DecodeError, and anything a fuzzed body triggers
        raise BadRequest(
            f"forward_backward body is not a tinker_public.ForwardBackwardRequest protobuf "
            f"({type(error).__name__}: {error})"
        ) from None
    if len(message.data) > MAX_DATUMS:
        raise BadRequest(
            f"forward_backward: more than {MAX_DATUMS} datums; one request carries at most "
            f"{MAX_DATUMS} (split the batch)"
        )
    return message


def _decompressed(body: bytes | bytearray | memoryview) -> bytes:
    import zstandard

    parts, size = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            while part := reader.read(1 << 20):
                size += len(part)
                if size > MAX_BODY_BYTES:
                    raise BadRequest(
                        f"forward_backward body decompresses to more than {MAX_BODY_BYTES} bytes"
                    )
                parts.append(part)
    except zstandard.ZstdError as error:
        raise BadRequest(f"forward_backward body is not valid zstd: {error}") from None
    return b"".join(parts)


def _datum(message: pb.Datum, *, index: int) -> Datum:
    # Runs for every datum of every forward_backward, on the event loop: the messages that
    # name a datum and field are built only on error.
    chunks = []
    for position, chunk in enumerate(message.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            where = f"datum {index}: model_input.chunks[{position}]"
            raise BadRequest(unsupported_chunk(str(kind), where=where))
        tokens = chunk.encoded_text.tokens
        if len(tokens) % 4:
            _frombuffer(tokens, np.int32, where=f"datum {index} tokens")  # raises
        chunks.append(EncodedTextChunk(tokens=tuple(np.frombuffer(tokens, np.int32).tolist())))
    inputs = {
        name: _tensor(tensor, index=index, name=name)
        for name, tensor in message.loss_fn_inputs.items()
    }
    return Datum(model_input=ModelInput(chunks=tuple(chunks)), loss_fn_inputs=inputs)


def _provenance(message: pb.Datum, *, index: int) -> Provenance | None:
    if not message.model_input_spans and not message.loss_fn_input_spans:
        return None
    return Provenance(
        model_input=_spans(message.model_input_spans, where=f"datum {index}: model_input_spans"),
        targets=_spans(message.loss_fn_input_spans, where=f"datum {index}: loss_fn_input_spans"),
    )


def _spans(messages, *, where: str) -> tuple[Span, ...]:
    spans = []
    for number, message in enumerate(messages):
        kind = message.WhichOneof("span")
        if kind is None:
            raise BadRequest(f"{where}[{number}]: neither prompt_tokens nor sampled_tokens is set")
        span = getattr(message, kind)
        spans.append(
            Span(
                kind="prompt" if kind == "prompt_tokens" else "sampled",
                sequence_id=span.sequence_id,
                offset=span.offset,
                length=span.length,
            )
        )
    return tuple(spans)


def _tensor(message: pb.Tensor, *, index: int, name: str) -> TensorData:
    known = _TENSOR_DTYPES.get(message.dtype)
    if known is None:
        raise BadRequest(
            f"{_input_where(index, name)}: unsupported dtype {message.dtype}; use float32 or int64"
        )
    np_dtype, dtype = known
    shape = tuple(message.shape)
    if message.HasField("sparse_csr"):
        where = _input_where(index, name)
        array = _dense_from_csr(message.sparse_csr, np_dtype, shape, where=where)
        return TensorData(data=array.reshape(-1).tolist(), dtype=dtype, shape=shape)
    dense = message.dense
    if len(dense) % np_dtype.itemsize:
        _frombuffer(dense, np_dtype, where=_input_where(index, name))  # raises
    values = np.frombuffer(dense, dtype=np_dtype).tolist()
    if not shape:
        shape = (len(values),)
    elif math.prod(shape) != len(values):
        raise BadRequest(
            f"{_input_where(index, name)}: {len(values)} values do not fill shape {list(shape)}"
        )
    return TensorData(data=values, dtype=dtype, shape=shape)


def _input_where(index: int, name: str) -> str:
    return f"datum {index}: loss_fn_inputs[{name!r}]"


def _dense_from_csr(csr: pb.SparseCsr, np_dtype, shape: tuple[int, ...], *, where: str):
    values = _frombuffer(csr.values, np_dtype, where=f"{where} values")
    crow = _frombuffer(csr.crow_indices, np.int64, where=f"{where} crow_indices")
    col = _frombuffer(csr.col_indices, np.int64, where=f"{where} col_indices")
    if len(shape) == 2 and min(shape) >= 0 and math.prod(shape) > MAX_SPARSE_VALUES:
        raise BadRequest(
            f"{where}: sparse CSR tensor of shape {list(shape)} would hold {math.prod(shape)} "
            f"values, more than {MAX_SPARSE_VALUES}; loss inputs are one value per token"
        )
    valid = (
        len(shape) == 2
        and crow.size == shape[0] + 1
        and crow[0] == 0
        and crow[-1] == values.size == col.size
        and bool(np.all(np.diff(crow) >= 0))
        and bool(np.all((col >= 0) & (col < shape[1])))
    )
    if not valid:
        raise BadRequest(f"{where}: inconsistent sparse CSR tensor of shape {list(shape)}")
    dense = np.zeros(shape, dtype=np_dtype)
    rows = np.repeat(np.arange(shape[0]), np.diff(crow))
    dense[rows, col] = values
    return dense


def _frombuffer(data: bytes, dtype, *, where: str) -> np.ndarray:
    if len(data) % np.dtype(dtype).itemsize:
        raise BadRequest(f"{where}: {len(data)} bytes is not a whole number of {dtype} values")
    return np.frombuffer(data, dtype=dtype)


def encode_forward_backward_output(output: ForwardBackwardOutput) -> bytes:
    message = pb.ForwardBackwardOutput(loss_fn_output_type=output.loss_fn_output_type)
    if not output.loss_fn_outputs:
        message.loss_fn_outputs.add(type_tag=output.loss_fn_output_type, num_datums=0)
    for chunk in _same_trailing_shapes(output.loss_fn_outputs):
        record = message.loss_fn_outputs.add(
            type_tag=output.loss_fn_output_type, num_datums=len(chunk)
        )
        for name in chunk[0]:
            _add_batched(record, name, [datum[name] for datum in chunk])
    for key, value in output.metrics.items():
        # The SDK splits every key on ':' when merging chunks; a bare name would crash it.
        message.metrics[key if ":" in key else f"{key}:mean"] = float(value)
    return message.SerializeToString()


def _same_trailing_shapes(
    outputs: list[dict[str, TensorData]],
) -> list[list[dict[str, TensorData]]]:
    """Runs of consecutive datums whose outputs have the same trailing shapes: a BatchedTensor
    holds one trailing shape (K of [T, K] logprobs), so a call mixing K takes several
    ArrayRecords, which the SDK concatenates in order."""
    chunks: list[list[dict[str, TensorData]]] = []
    previous = None
    for datum in outputs:
        key = {name: tensor.shape[1:] for name, tensor in datum.items()}
        if key != previous:
            chunks.append([])
            previous = key
        chunks[-1].append(datum)
    return chunks


def _add_batched(record: pb.ArrayRecord, name: str, tensors: list[TensorData]) -> None:
    np_dtype, wire_dtype = _OUTPUT_DTYPES[tensors[0].dtype]
    arrays = [np.asarray(tensor.data, dtype=np_dtype) for tensor in tensors]
    offsets = np.cumsum([0, *(array.nbytes for array in arrays)], dtype=np.int64)
    batched = record.fields[name]
    batched.data = b"".join(array.tobytes() for array in arrays)
    batched.offsets = offsets.tobytes()
    batched.dtype = wire_dtype
    batched.trailing_shape.extend(tensors[0].shape[1:])


# -- sampling: JSON in, protobuf out ----------------------------------------------------------


def decode_sample(request: tinker_types.SampleRequest) -> SampleCall:
    if request.prompt_alt_tokens_k:
        raise BadRequest("prompt_alt_tokens_k is not supported by this server; send 0")
    prompt = model_input(request.prompt, where="prompt")
    params = request.sampling_params
    stop = params.stop
    _check_stop(stop)
    try:
        sampling_params = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            stop=stop if stop is None or isinstance(stop, str) else list(stop),
            seed=params.seed,
        )
    except (TypeError, ValueError) as error:
        raise BadRequest(f"sampling_params: {error}") from None
    topk_prompt = request.topk_prompt_logprobs
    last_n = request.prompt_logprobs_last_n
    targets = request.target_prompt_logprobs
    if last_n is not None and not 1 <= last_n <= prompt.length - 1:
        raise BadRequest(
            f"prompt_logprobs_last_n must be in [1, {prompt.length - 1}] (prompt length - 1), "
            f"got {last_n}"
        )
    return SampleCall(
        prompt=prompt,
        num_samples=request.num_samples,
        params=sampling_params,
        prompt_logprobs=bool(request.prompt_logprobs) or topk_prompt > 0,
        topk_prompt_logprobs=topk_prompt,
        topk_sample_logprobs=request.topk_sample_logprobs,
        prompt_logprobs_last_n=last_n,
        record_stability_info=bool(request.record_stability_info),
        target_prompt_logprobs=None if targets is None else decode_targets(targets),
        target_sparse=targets is not None and targets.sparse_crow_indices is not None,
    )


def _check_stop(stop: str | Sequence[str] | Sequence[int] | None) -> None:
    """Bounded before SamplingParams checks the entries (and echoes the list when one is bad)."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOPS:
        raise BadRequest(
            f"sampling_params.stop has {len(stops)} entries; at most {MAX_STOPS} stop strings "
            "or stop token ids are allowed"
        )
    for index, entry in enumerate(stops):
        if isinstance(entry, str) and len(entry) > MAX_STOP_CHARS:
            raise BadRequest(
                f"sampling_params.stop[{index}] has {len(entry)} characters; at most "
                f"{MAX_STOP_CHARS}"
            )


def model_input(value: tinker_types.ModelInput, *, where: str) -> ModelInput:
    chunks = []
    for position, chunk in enumerate(value.chunks):
        if not isinstance(chunk, tinker_types.EncodedTextChunk):
            kind = getattr(chunk, "type", type(chunk).__name__)
            raise BadRequest(unsupported_chunk(kind, where=f"{where}.chunks[{position}]"))
        chunks.append(EncodedTextChunk(tokens=tuple(int(token) for token in chunk.tokens)))
    return ModelInput(chunks=tuple(chunks))


def encode_sample_response(
    response: SampleResponse, *, call: SampleCall, prompt_length: int
) -> bytes:
    message = pb.SampleResponse(prompt_cache_hit_tokens=response.prompt_cache_hit_tokens)
    for sequence in response.sequences:
        wire = message.sequences.add(
            stop_reason=pb.STOP_REASON_STOP
            if sequence.stop_reason == "stop"
            else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(sequence.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype=np.float32).tobytes(),
        )
        if call.topk_sample_logprobs and sequence.topk_logprobs is not None:
            wire.topk_sampled_logprobs.CopyFrom(
                _topk(sequence.topk_logprobs, k=call.topk_sample_logprobs)
            )
    # Positions before the last n are left unscored (NaN / empty), as the SDK checks.
    first_scored = prompt_length - (call.prompt_logprobs_last_n or prompt_length)
    if call.prompt_logprobs and response.prompt_logprobs is not None:
        values = [
            math.nan if value is None or position < first_scored else value
            for position, value in enumerate(response.prompt_logprobs)
        ]
        message.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if call.topk_prompt_logprobs and response.topk_prompt_logprobs is not None:
        rows = [
            row if position >= first_scored else None
            for position, row in enumerate(response.topk_prompt_logprobs)
        ]
        message.topk_prompt_logprobs.CopyFrom(_topk(rows, k=call.topk_prompt_logprobs))
    if call.target_prompt_logprobs is not None and response.target_prompt_logprobs is not None:
        message.target_prompt_logprobs.CopyFrom(
            encode_target_logprobs(response.target_prompt_logprobs, sparse=call.target_sparse)
        )
    return message.SerializeToString()


def _topk(rows: list[TopkLogprobs | None], *, k: int) -> pb.TopkLogprobs:
    token_ids = np.full((len(rows), k), _EMPTY_TOPK[0], dtype=np.int32)
    logprobs = np.full((len(rows), k), _EMPTY_TOPK[1], dtype=np.float32)
    for position, row in enumerate(rows):
        for rank, (token, value) in enumerate((row or [])[:k]):
            token_ids[position, rank] = token
            logprobs[position, rank] = value
    return pb.TopkLogprobs(
        token_ids=token_ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows)
    )


# -- small JSON conversions -----------------------------------------------------------------


def adam_params(params: object) -> AdamParams:
    if not isinstance(params, tinker_types.AdamParams):
        kind = getattr(params, "type", type(params).__name__)
        raise BadRequest(f"optim_step: optimizer {kind!r} is not supported; send adam_params")
    try:
        return AdamParams(**params.model_dump())
    except (TypeError, ValueError) as error:
        raise BadRequest(f"adam_params: {error}") from None
