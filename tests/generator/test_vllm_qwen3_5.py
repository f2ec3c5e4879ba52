"""The vLLM backend on a Qwen3.5 model (Gated DeltaNet + gated attention) on vLLM's CPU build:
refused before vLLM starts where that build cannot run it (no CPU torchvision, a dtype other
than bfloat16, linear heads its kernel lacks), naming each reason; where it can, vLLM's
greedy tokens are Temper's full-forward argmax, its logprobs close to Temper's (bf16), and
new weights reach it through the weight-transfer path under the hybrid layers' HF names."""

from __future__ import annotations

import copy
import dataclasses
import tempfile

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize
from temper.models.qwen3_5.sizes import qwen3_5_size
from temper.sampler.requests import SampleRequest
from temper.tokenizer import build_builtin_tokenizer

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.generator import vllm_hybrid  # noqa: E402
from temper.generator.vllm import VllmGenerator  # noqa: E402

PROMPTS = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1, 6, 2] * 3]
# vLLM computes in bf16 (its CPU kernel's only dtype); the reference is Temper's forward in
# fp32 on the same bf16 weights. Measured: within 4e-3 of transformers' bf16 forward.
TOLERANCE = 2e-2
TORCHVISION_PROBLEM = vllm_hybrid.torchvision_problem()
runs_on_cpu = pytest.mark.skipif(
    TORCHVISION_PROBLEM is not None and not torch.cuda.is_available(),
    reason=f"vLLM's CPU build cannot import its Qwen3.5 model here: {TORCHVISION_PROBLEM}",
)


def _model(*, head_dim: int = 64, dtype: str = "bfloat16", seed: int = 5):
    tokenizer = build_builtin_tokenizer("digits")
    config = dataclasses.replace(
        qwen3_5_size("tiny", vocab_size=tokenizer.vocab_size),
        max_seq_len=64,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
    )
    return materialize(config, seed=seed, dtype=dtype).eval(), tokenizer


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CUDA build runs these")
def test_cpu_refuses_fp32_and_narrow_linear_heads_before_starting(tmp_path, monkeypatch):
    model, tokenizer = _model(head_dim=32, dtype="float32")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ValueError) as refused:
        VllmGenerator.Config(kv_cache_mib=64).build(model=model, tokenizer=tokenizer)
    message = str(refused.value)
    assert "Qwen3_5ForCausalLM" in message and "vLLM's CPU build" in message
    assert "bfloat16 only, not float32" in message
    assert "linear_key_head_dim=32" in message and "[64, 128]" in message
    assert "--generator.backend temper" in message
    assert not list(tmp_path.iterdir())  # no model directory written, nothing started


@pytest.mark.skipif(
    TORCHVISION_PROBLEM is None or torch.cuda.is_available(),
    reason="a CPU torchvision imports here, so vLLM's CPU build runs Qwen3.5",
)
def test_cpu_refuses_without_a_cpu_torchvision():
    model, tokenizer = _model()
    with pytest.raises(ValueError, match="torchvision") as refused:
        VllmGenerator.Config(kv_cache_mib=64).build(model=model, tokenizer=tokenizer)
    assert vllm_hybrid.CPU_TORCHVISION in str(refused.value)
    assert "bfloat16 only" not in str(refused.value)  # the model itself would run


def test_dense_model_passes_the_hybrid_checks():
    from temper.models import qwen3_size

    config = qwen3_size("tiny", vocab_size=16)
    assert not vllm_hybrid.is_hybrid(config)
    assert vllm_hybrid.engine_arguments(config) == {}
    vllm_hybrid.check_cpu(config, dtype="float32", family="Qwen3ForCausalLM")


def test_hybrid_engine_arguments_reserve_attention_kv_and_states():
    from temper.generator.vllm_arguments import engine_arguments
    from temper.sampler.recurrent_pool import RecurrentPoolShape

    model, _ = _model()
    config = model.config
    arguments = engine_arguments(
        model_dir="unused",
        model_config=config,
        dtype="bfloat16",
        max_model_len=64,
        max_num_seqs=8,
        kv_cache_mib=None,
        tensor_parallel_size=1,
        eager=True,
        sleep="off",
        gpu_memory_fraction=None,
        tokenizer_given=False,
        gpu=None,
    )
    assert arguments["mamba_ssm_cache_dtype"] == "float32"  # Temper's state dtype
    # Keys/values of the one full-attention layer, and two states per linear layer (vLLM's
    # prefix-caching 'align' mode), the states as Temper's pool counts them.
    attention = len(config.attention_layers) * 2 * config.num_kv_heads * config.head_dim * 2
    pool = RecurrentPoolShape.for_model(config, num_slots=1).bytes_per_slot(torch.bfloat16)
    assert arguments["kv_cache_memory_bytes"] == 8 * (64 * attention + 2 * pool)


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = _model()
    generator = VllmGenerator.Config(kv_cache_mib=64).build(model=model, tokenizer=tokenizer)
    yield generator, model
    generator.close()


def _greedy(generator) -> tuple[list[list[int]], list[list[float]]]:
    greedy = SamplingParams(max_tokens=12, temperature=0, stop=[])
    requests = [SampleRequest(prompt=p, params=greedy) for p in PROMPTS]
    responses = generator.generate(requests)
    return [r.sequences[0].tokens for r in responses], [r.sequences[0].logprobs for r in responses]


def _reference_logprobs(model, sequence: list[int]) -> torch.Tensor:
    """Temper's full (chunked) forward in fp32 on the model's bf16 weights: logprobs [T, V]
    of the tokens after each position."""
    reference = copy.deepcopy(model).float()
    with torch.no_grad():
        return reference(torch.tensor([sequence]))[0].log_softmax(-1)


def _check_against_full_forward(model, tokens, logprobs) -> None:
    """Each greedy token is the argmax of Temper's full forward over the sequence (or ties
    it within the tolerance), and its logprob is close to that forward's."""
    for prompt, sampled, sampled_logprobs in zip(PROMPTS, tokens, logprobs, strict=True):
        logprobs_TV = _reference_logprobs(model, prompt + sampled[:-1])[len(prompt) - 1 :]
        reference = logprobs_TV.gather(-1, torch.tensor(sampled)[:, None])[:, 0]
        best = logprobs_TV.max(-1).values
        assert (best - reference).max().item() < TOLERANCE  # argmax, up to near-ties
        assert (torch.tensor(sampled_logprobs) - reference).abs().max().item() < TOLERANCE


@runs_on_cpu
def test_greedy_tokens_are_the_full_forward_argmax(engine):
    generator, model = engine
    tokens, logprobs = _greedy(generator)
    _check_against_full_forward(model, tokens, logprobs)


@runs_on_cpu
def test_prompt_logprobs_are_close_to_temper_scoring(engine):
    generator, model = engine
    sequence = PROMPTS[2]
    scored = generator.score([sequence])[0]
    logprobs_TV = _reference_logprobs(model, sequence[:-1])
    reference = logprobs_TV.gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]
    assert (scored - reference).abs().max().item() < TOLERANCE


@runs_on_cpu
def test_weight_update_reaches_the_hybrid_layers(engine):
    generator, _ = engine
    other, _ = _model(seed=11)
    generator.update_weights(other.state_dict(), version=1)
    tokens, logprobs = _greedy(generator)
    _check_against_full_forward(other, tokens, logprobs)
    assert generator.version == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CUDA build runs these")
def test_train_refuses_before_the_warmup_and_writes_no_run_directory(tmp_path, capsys):
    from temper.cli import main

    run_dir = tmp_path / "run"
    argv = ["train", "sum_digits_hybrid", "--run-dir", str(run_dir), "--metrics.display", "none"]
    assert main([*argv, "--generator.backend", "vllm"]) == 2  # a settings error, not a run's
    captured = capsys.readouterr()
    assert "Qwen3_5ForCausalLM" in captured.err and "vLLM's CPU build" in captured.err
    assert "bfloat16 only, not float32" in captured.err  # CPU runs train in fp32
    assert "linear_key_head_dim=32" in captured.err  # qwen3_5/tiny's heads
    assert "--generator.backend temper" in captured.err
    assert "SFT warm-up" not in captured.out  # nothing ran
    assert not run_dir.exists()
