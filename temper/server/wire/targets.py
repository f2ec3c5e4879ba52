"""`target_prompt_logprobs` on the wire: the JSON request tensor in, the protobuf answer out.

The request is the SDK's JSON TensorData, int64 of shape [len(prompt) - 1, K], dense or
sparse CSR (`TensorData.from_torch_sparse(ids, pad_value=-1)`: the listed values are the
ids themselves). A sparse request is kept as its listed cells, never densified. The answer
is a float32 `Tensor` of the request's shape and layout: dense bytes for a dense request,
the same crow/col indices for a sparse one, 0.0 in the cells that named no id
(`tinker/proto/response_conv.py::_tensor_data_from_proto` reads it).
"""

from __future__ import annotations

import math

import numpy as np
from tinker.proto import tinker_public_pb2 as pb
from tinker.types._pydantic_types.tensor_data import TensorData as WireTensorData

from temper.api.prompt_targets import PromptTargetLogprobs, PromptTargets
from temper.server.http.errors import BadRequest

FIELD = "target_prompt_logprobs"


def decode_targets(value: WireTensorData) -> PromptTargets:
    """The request's ids as `PromptTargets`; a 400 names the field for a malformed tensor
    (its fit to the prompt and vocabulary is `PromptTargets.check`, in routes/validation.py)."""
    if value.dtype != "int64":
        raise BadRequest(f"{FIELD} must be an int64 tensor of token ids, got {value.dtype}")
    shape = tuple(value.shape or ())
    if len(shape) != 2:
        raise BadRequest(f"{FIELD} must be 2-D, [len(prompt) - 1, K], got shape {list(shape)}")
    ids = np.asarray(value.data)
    if ids.size and ids.dtype.kind != "i":
        raise BadRequest(f"{FIELD} must hold integer token ids, got {ids.dtype} values")
    crow, cols = value.sparse_crow_indices, value.sparse_col_indices
    if (crow is None) != (cols is None):
        raise BadRequest(f"{FIELD}: sparse_crow_indices and sparse_col_indices go together")
    try:
        if crow is None:
            if ids.size != math.prod(shape):
                raise BadRequest(f"{FIELD}: {ids.size} values do not fill shape {list(shape)}")
            return PromptTargets.from_ids(ids.reshape(shape).astype(np.int64))
        return PromptTargets(
            shape=shape,
            crow_indices=tuple(crow),
            col_indices=tuple(cols),
            token_ids=tuple(ids.tolist()),
        )
    except (TypeError, ValueError) as error:
        raise BadRequest(str(error)) from None


def encode_target_logprobs(answer: PromptTargetLogprobs, *, sparse: bool) -> pb.Tensor:
    message = pb.Tensor(dtype=pb.DTYPE_FLOAT32)
    message.shape.extend(answer.shape)
    if sparse:
        message.sparse_csr.values = np.asarray(answer.logprobs, dtype=np.float32).tobytes()
        message.sparse_csr.crow_indices = np.asarray(answer.crow_indices, np.int64).tobytes()
        message.sparse_csr.col_indices = np.asarray(answer.col_indices, np.int64).tobytes()
    else:
        message.dense = answer.to_torch().numpy().tobytes()
    return message
