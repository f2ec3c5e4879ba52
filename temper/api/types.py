"""Domain types mirroring Tinker's names and semantics (the server converts wire types to these).

Cookbook-style code reads the same against these as against the `tinker` SDK's types:
`ModelInput.from_ints`, `TensorData.from_torch(...).to_torch()`, `Datum(model_input=...,
loss_fn_inputs={...})`, `AdamParams(learning_rate=...)`. Loss inputs given as torch tensors,
numpy arrays or lists are converted to `TensorData` when a `Datum` is made.
"""

from __future__ import annotations

import math
import operator
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from temper.api.prompt_targets import PromptTargetLogprobs
from temper.config.checks import check_choice, check_range

StopReason = Literal["stop", "length"]
TopkLogprobs = list[tuple[int, float]]
"""The k most likely (token id, logprob) pairs at one position, most likely first."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to draw completions (Tinker semantics).

    temperature 0 means greedy decoding. top_k -1 (Tinker's default) or 0 means no top-k limit.
    stop: None stops at the tokenizer's EOS; a string or list of strings adds stop strings; a
    list of ints adds stop token ids (EOS still stops in both cases); [] disables stopping
    entirely, EOS included, so generation runs to max_tokens.
    """

    max_tokens: int | None = None
    """Most tokens to generate; None: up to the sampler's context limit."""
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: str | Sequence[str] | Sequence[int] | None = None
    seed: int | None = None
    """Same seed, prompt and weights give the same tokens, whatever else shares the batch (on
    CPU; on CUDA, kernels chosen by batch size can move logits at a near tie)."""
    return_support: bool = False
    """Temper's field (not Tinker's): also return, for every sampled token, the token ids
    top-k/top-p kept when it was drawn (`SampledSequence.support`), so a trainer can
    renormalise its distribution over the same support (losses/support.py). Needs a
    temperature > 0; the vllm backend also needs top_k >= 1 (see docs/rl.md)."""

    def __post_init__(self) -> None:
        check_range(self.max_tokens, field="max_tokens", integer=True, also=(None,))
        if self.max_tokens is not None:
            check_range(self.max_tokens, field="max_tokens", greater_than=0, hint="or None")
        check_range(self.temperature, field="temperature", at_least=0, finite=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or -1/0 for no limit, got {self.top_k!r}")
        if self.top_k > _INT64_MAX:  # samplers hold it as an int64
            raise ValueError(
                f"top_k must be at most 2**63 - 1 (any top_k of the vocabulary size or more "
                f"keeps every token), got {self.top_k}"
            )
        check_range(self.top_p, field="top_p", greater_than=0, at_most=1)
        check_range(self.seed, field="seed", integer=True, also=(None,))
        _check_stop(self.stop)
        if not isinstance(self.return_support, bool):
            raise TypeError(f"return_support must be a bool, got {self.return_support!r}")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if isinstance(self.stop, str):
            return (self.stop,)
        if self.stop and isinstance(self.stop[0], str):
            return tuple(self.stop)
        return ()

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        if self.stop and not isinstance(self.stop, str) and isinstance(self.stop[0], int):
            return tuple(self.stop)
        return ()

    @property
    def stops_at_eos(self) -> bool:
        return self.stop is None or len(self.stop) > 0


def _check_stop(stop: object) -> None:
    if stop is None or isinstance(stop, str):
        if stop == "":
            raise ValueError("stop must not be the empty string")
        return
    if not isinstance(stop, Sequence):
        raise TypeError(f"stop must be None, a string, or a list of strings or ints, got {stop!r}")
    kinds = {type(item) for item in stop}
    if kinds - {str, int} or len(kinds) > 1:
        raise TypeError(f"stop must be all strings or all ints, got {list(stop)!r}")
    if any(item == "" for item in stop):
        raise ValueError("stop strings must not be empty")
    if any(isinstance(item, int) and item < 0 for item in stop):
        raise ValueError(f"stop token ids must be >= 0, got {list(stop)!r}")


RoutingReplay = Literal["off", "sampler"]
"""How forward_backward routes a MoE model's tokens: 'off', by its own router; 'sampler', to
the experts the sampler routed them to (each datum's `routed_experts`), with the router's
weights at those experts (so the router still learns)."""
RouteDType = Literal["uint8", "int16"]
_ROUTE_DTYPES = {"uint8": torch.uint8, "int16": torch.int16}


@dataclass(frozen=True, kw_only=True)
class RoutedExperts:
    """The experts a MoE model routed tokens to: for each of T tokens and each of its L sparse
    layers (in layer order), the K experts of the token's top-k, in the router's order.

    Held compactly as the bytes of a row-major [T, L, K] array of small ints (uint8 for up to
    256 experts, else int16): a few hundred bytes per token for the largest published MoE
    models, and a plain value to pickle or copy between processes."""

    data: bytes
    shape: tuple[int, int, int]
    """(T tokens, L sparse layers, K experts per token)."""
    dtype: RouteDType = "uint8"

    def __post_init__(self) -> None:
        check_choice(self.dtype, field="RoutedExperts.dtype", choices=tuple(_ROUTE_DTYPES))
        shape = tuple(self.shape)
        if len(shape) != 3 or any(
            isinstance(size, bool) or not isinstance(size, int) or size < 0 for size in shape
        ):
            raise ValueError(
                f"RoutedExperts.shape must be (tokens, layers, top_k) ints >= 0, got {shape!r}"
            )
        object.__setattr__(self, "shape", shape)
        itemsize = _ROUTE_DTYPES[self.dtype].itemsize
        if len(self.data) != math.prod(shape) * itemsize:
            raise ValueError(
                f"RoutedExperts holds {len(self.data)} bytes but shape {list(shape)} of "
                f"{self.dtype} needs {math.prod(shape) * itemsize}"
            )

    @classmethod
    def from_torch(cls, experts_TLK: torch.Tensor, *, num_experts: int) -> RoutedExperts:
        """Routes of an integer tensor [T, L, K], stored in the smallest dtype that holds
        `num_experts` ids."""
        dtype: RouteDType = "uint8" if num_experts <= 256 else "int16"
        compact = experts_TLK.detach().to("cpu", _ROUTE_DTYPES[dtype]).contiguous()
        return cls(data=compact.numpy().tobytes(), shape=tuple(experts_TLK.shape), dtype=dtype)

    def to_torch(self) -> torch.Tensor:
        """The expert ids as an int64 tensor [T, L, K]."""
        if not self.data:
            return torch.zeros(self.shape, dtype=torch.int64)
        flat = torch.frombuffer(bytearray(self.data), dtype=_ROUTE_DTYPES[self.dtype])
        return flat.to(torch.int64).view(self.shape)

    @property
    def num_tokens(self) -> int:
        return self.shape[0]


@dataclass(frozen=True, kw_only=True)
class SampledSequence:
    tokens: list[int]
    """Generated tokens; a stop token or the tokens completing a stop string are included."""
    logprobs: list[float]
    """Logprob of each generated token under the distribution it was drawn from."""
    stop_reason: StopReason
    topk_logprobs: list[TopkLogprobs] | None = None
    """Per generated position, when requested."""
    routed_experts: RoutedExperts | None = None
    """MoE models, when the sampler records routes: the experts every token the model ran
    for this sequence was routed to, the prompt's then each generated token's but the last
    (which was never fed back): len(prompt) + len(tokens) - 1 tokens, the positions of the
    training datum `prompt + tokens[:-1]`."""
    support: list[list[int]] | None = None
    """With `SamplingParams.return_support`: per generated position, the token ids (ascending)
    that top-k/top-p kept in the distribution the token was drawn from; the token is one of
    them, and its logprob is normalised over exactly these."""
    weight_versions: tuple[int, ...] | None = None
    """In-flight sampling clients: the policy versions this sequence was decoded with, oldest
    first (more than one when the weights were updated while it decoded:
    temper/sampler/weight_switch.py); None from other clients (one fixed version)."""


@dataclass(frozen=True, kw_only=True)
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    """Per prompt position (None at position 0), when requested."""
    topk_prompt_logprobs: list[TopkLogprobs | None] | None = None
    """Per prompt position (None at position 0), when requested."""
    target_prompt_logprobs: PromptTargetLogprobs | None = None
    """The logprobs of the ids asked for by `target_prompt_logprobs`, when requested: the
    request's [len(prompt) - 1, K] layout (`.to_torch()`), 0.0 in cells naming no id."""
    prompt_cache_hit_tokens: int = 0
    """Prompt tokens whose keys/values the sampler did not compute for this request: those
    its prefix cache served, or the whole prompt when another request admitted with it
    prefilled the same one. Counted once per request, whatever `num_samples`."""


TensorDType = Literal["int64", "float32"]
_TORCH_DTYPES = {"int64": torch.int64, "float32": torch.float32}
_ARRAY_TYPECODES = {"int64": "q", "float32": "f"}


def numbers_to_tensor(values: Sequence[int | float], *, dtype: TensorDType) -> torch.Tensor:
    """A 1-d tensor of Python numbers, equal to `torch.tensor(values, dtype=...)` but built
    through an `array` buffer: about 10x faster for ints and 3x for floats (1,500 values: 24 us
    against 240 us and 74 us), which matters for the thousands of token ids and loss inputs a
    training call converts. Values an array refuses (an int past int64, a float marked int64)
    go through `torch.tensor`, which raises or converts as it always did."""
    torch_dtype = _TORCH_DTYPES[dtype]
    try:
        buffer = array(_ARRAY_TYPECODES[dtype], values)
    except (TypeError, OverflowError):
        return torch.tensor(values, dtype=torch_dtype)
    if not buffer:
        return torch.empty(0, dtype=torch_dtype)
    return torch.frombuffer(buffer, dtype=torch_dtype)


@dataclass(frozen=True, kw_only=True)
class TensorData:
    """A dense array: flat `data` in row-major order, its `dtype` and `shape`."""

    data: list[int] | list[float]
    dtype: TensorDType
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        check_choice(self.dtype, field="TensorData.dtype", choices=tuple(_TORCH_DTYPES))
        if math.prod(self.shape) != len(self.data):
            raise ValueError(f"TensorData has {len(self.data)} values but shape {list(self.shape)}")

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        if tensor.dtype.is_floating_point:
            dtype: TensorDType = "float32"
        elif tensor.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            dtype = "int64"
        else:
            raise TypeError(f"TensorData holds int64 or float32 values, got {tensor.dtype}")
        flat = tensor.detach().to("cpu", _TORCH_DTYPES[dtype]).reshape(-1)
        return cls(data=flat.tolist(), dtype=dtype, shape=tuple(tensor.shape))

    @classmethod
    def from_numpy(cls, array: Any) -> TensorData:
        return cls.from_torch(torch.from_numpy(array))

    def to_torch(self) -> torch.Tensor:
        return torch.tensor(self.data, dtype=_TORCH_DTYPES[self.dtype]).reshape(self.shape)

    def tolist(self) -> list:
        return self.to_torch().tolist()

    @staticmethod
    def concat_to_torch(values: Sequence[TensorData]) -> torch.Tensor:
        """The values of several TensorData of one dtype, flattened and concatenated: one
        tensor built from Python numbers instead of one per TensorData."""
        dtypes = {value.dtype for value in values}
        if len(dtypes) != 1:
            raise ValueError(f"concat_to_torch needs one dtype, got {sorted(dtypes)}")
        flat = [number for value in values for number in value.data]
        return numbers_to_tensor(flat, dtype=dtypes.pop())


def to_tensor_data(value: Any, *, name: str) -> TensorData:
    """Accept TensorData, a torch tensor, a numpy array or a (nested) list of numbers."""
    if isinstance(value, TensorData):
        return value
    if isinstance(value, torch.Tensor):
        return TensorData.from_torch(value)
    if hasattr(value, "__array__") and not isinstance(value, list | tuple):
        return TensorData.from_torch(torch.as_tensor(value))
    if isinstance(value, list | tuple):
        flat = _flat_numbers(value)
        if flat is not None:
            return flat
        try:
            return TensorData.from_torch(torch.tensor(value))
        except (TypeError, ValueError) as error:
            raise TypeError(f"loss_fn_inputs[{name!r}]: not a numeric array ({error})") from None
    raise TypeError(
        f"loss_fn_inputs[{name!r}] must be TensorData, a torch tensor, a numpy array or a list, "
        f"got {type(value).__name__}"
    )


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _flat_numbers(values: list | tuple) -> TensorData | None:
    """A flat list of Python ints (int64) or floats (rounded to float32 as torch would, by
    `array('f')`), without a round trip through a tensor; None for anything else."""
    kinds = set(map(type, values))  # C-level passes: this runs for every datum's inputs
    if kinds == {int}:
        if min(values) >= _INT64_MIN and max(values) <= _INT64_MAX:
            return TensorData(data=list(values), dtype="int64", shape=(len(values),))
        return None
    if kinds == {float}:
        return TensorData(data=array("f", values).tolist(), dtype="float32", shape=(len(values),))
    return None


def _token_id(token: Any) -> int:
    """An int token id (numpy and 0-d torch ints too); a float is an error, not truncated,
    and so is a bool (an int to Python, but never a token id)."""
    try:
        if not isinstance(token, bool):
            return operator.index(token)
    except TypeError:
        pass
    raise TypeError(f"token ids must be ints, got {token!r}")


@dataclass(frozen=True, kw_only=True)
class EncodedTextChunk:
    tokens: tuple[int, ...]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, kw_only=True)
class ImageChunk:
    """An image given inline (Tinker's `ImageChunk`). Temper's models read text only: every
    verb refuses a `ModelInput` holding one (`unsupported_chunk`) before any work starts."""

    data: bytes
    format: Literal["png", "jpeg"]
    expected_tokens: int | None = None
    """The tokens the image stands for, as the caller expects them (advisory)."""
    type: Literal["image"] = "image"

    @property
    def length(self) -> int:
        return _image_length(self)


@dataclass(frozen=True, kw_only=True)
class ImageAssetPointerChunk:
    """An image named by a path or URL (Tinker's `ImageAssetPointerChunk`); refused by every
    verb as `ImageChunk` is."""

    format: Literal["png", "jpeg"]
    location: str
    expected_tokens: int | None = None
    """The tokens the image stands for, as the caller expects them (advisory)."""
    type: Literal["image_asset_pointer"] = "image_asset_pointer"

    @property
    def length(self) -> int:
        return _image_length(self)


def _image_length(chunk: ImageChunk | ImageAssetPointerChunk) -> int:
    if chunk.expected_tokens is None:
        raise ValueError(f"{type(chunk).__name__}.length needs expected_tokens to be set")
    return chunk.expected_tokens


ModelInputChunk = EncodedTextChunk | ImageChunk | ImageAssetPointerChunk
_CHUNK_TYPES = (EncodedTextChunk, ImageChunk, ImageAssetPointerChunk)
_CHUNK_KINDS = {
    "image": "an image chunk",
    "image_asset_pointer": "an image chunk",
    "dmel": "an audio (dmel) chunk",
}


def unsupported_chunk(kind: str, *, where: str) -> str:
    """The message refusing a chunk of type `kind` ('image', 'image_asset_pointer', 'dmel')
    found at `where` (e.g. "datum 0: model_input.chunks[1]"): Temper's models read text only,
    so the Python API and the server say the same thing."""
    what = _CHUNK_KINDS.get(kind, "a chunk")
    return (
        f"{where} is {what} (type {kind!r}): image and audio inputs are not supported; "
        "Temper's models read text only (encoded_text chunks)"
    )


@dataclass(frozen=True, kw_only=True)
class ModelInput:
    """Model input as chunks, concatenated in order: token ids (`EncodedTextChunk`), or images
    (`ImageChunk`, `ImageAssetPointerChunk`), which the API carries as Tinker's does and every
    verb refuses, naming the chunk, since Temper's models read text only."""

    chunks: tuple[ModelInputChunk, ...] = ()

    def __post_init__(self) -> None:
        for index, chunk in enumerate(self.chunks):
            if not isinstance(chunk, _CHUNK_TYPES):
                raise TypeError(
                    f"ModelInput.chunks[{index}] must be an EncodedTextChunk, ImageChunk or "
                    f"ImageAssetPointerChunk, got {type(chunk).__name__}"
                )

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        tokens = tuple(tokens)
        if not set(map(type, tokens)) <= {int}:  # C-level check; anything else is converted
            tokens = tuple(map(_token_id, tokens))
        return cls(chunks=(EncodedTextChunk(tokens=tokens),))

    @classmethod
    def empty(cls) -> ModelInput:
        return cls()

    def check_text_only(self, *, where: str = "model_input") -> None:
        """A ValueError naming the first chunk that is not text (an image), if any; `where`
        names this input in it (e.g. "datum 3: model_input")."""
        for index, chunk in enumerate(self.chunks):
            if type(chunk) is not EncodedTextChunk:
                raise ValueError(unsupported_chunk(chunk.type, where=f"{where}.chunks[{index}]"))

    def to_ints(self, *, where: str = "model_input") -> list[int]:
        """The token ids of every chunk, in order (text only: see `check_text_only`)."""
        self.check_text_only(where=where)
        return [token for chunk in self.chunks for token in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def append_int(self, token: int) -> ModelInput:
        return ModelInput.from_ints([*self.to_ints(), int(token)])


@dataclass(frozen=True, kw_only=True)
class Datum:
    """One training example: the input tokens and its loss inputs, aligned position by position
    (position i of the input predicts `target_tokens[i]`)."""

    model_input: ModelInput
    loss_fn_inputs: Mapping[str, TensorData] = field(default_factory=dict)
    routed_experts: RoutedExperts | None = None
    """MoE models: the experts the sampler routed each model_input token to (the sampled
    sequence's `routed_experts`), for `forward_backward(..., routing_replay="sampler")` to
    replay and for the router agreement metrics; a Temper extension (Tinker's datums have
    none)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_input, ModelInput):
            raise TypeError(f"Datum.model_input must be a ModelInput, got {self.model_input!r}")
        if self.routed_experts is not None and not isinstance(self.routed_experts, RoutedExperts):
            raise TypeError(
                "Datum.routed_experts must be RoutedExperts or None, got "
                f"{type(self.routed_experts).__name__}"
            )
        converted = {
            name: to_tensor_data(value, name=name) for name, value in self.loss_fn_inputs.items()
        }
        object.__setattr__(self, "loss_fn_inputs", converted)


@dataclass(frozen=True, kw_only=True)
class AdamParams:
    """One AdamW step's hyperparameters (Tinker defaults)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    grad_clip_norm: float = 0.0
    """Clip the global gradient norm to this first; 0 disables clipping."""

    def __post_init__(self) -> None:
        check_range(self.learning_rate, field="AdamParams.learning_rate", at_least=0)
        for name in ("beta1", "beta2"):
            check_range(getattr(self, name), field=f"AdamParams.{name}", at_least=0, less_than=1)
        check_range(self.eps, field="AdamParams.eps", greater_than=0)
        check_range(self.weight_decay, field="AdamParams.weight_decay", at_least=0)
        check_range(
            self.grad_clip_norm,
            field="AdamParams.grad_clip_norm",
            at_least=0,
            hint="0 disables clipping",
        )


@dataclass(frozen=True, kw_only=True)
class ForwardBackwardOutput:
    loss_fn_outputs: list[dict[str, TensorData]]
    """Per datum: 'logprobs' (the trainer's logprob of each target) and 'elementwise_loss'."""
    metrics: dict[str, float]
    """Named `name:reduction`, e.g. 'loss:sum'."""
    loss_fn_output_type: str = "ArrayRecord"


@dataclass(frozen=True, kw_only=True)
class OptimStepResponse:
    metrics: dict[str, float]
    """'grad_norm:mean' (before clipping), 'learning_rate:mean', 'policy_version:max'."""


@dataclass(frozen=True, kw_only=True)
class SaveWeightsResponse:
    path: str


@dataclass(frozen=True, kw_only=True)
class LoadWeightsResponse:
    path: str
