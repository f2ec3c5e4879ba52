"""`temper sample`: completions of a raw-text prompt from a model directory, for a person to read.

The prompt is encoded as is (no chat template), unless `--chat FORMAT` makes it a user message
in that chat format (a renderer: the format an SFT conversations run trained on), whose
generation prompt is sampled from and whose end-of-reply stop applies. The sampler is sized to
this one call: one KV-cache slot per completion and exactly prompt + max_tokens positions, so a
large model does not reserve its whole context.
Completions are shown with their special tokens (an EOS that ended one is visible).
`--model` also takes a sampler checkpoint directory (`save_weights_for_sampler`, e.g. a
run's final weights): a full model, or LoRA adapters merged into the base model it names; and
a run directory (`temper train --run-dir`), which stands for its newest final sampler weights.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import rich.console
import rich.rule
import rich.table
import rich.text
import tyro

from temper.api.types import SampledSequence, SamplingParams
from temper.checkpoint.model_source import DType, ModelSource
from temper.client.sampler_weights import SAMPLER_FILE, SamplerWeights, load_sampler_directory
from temper.sampler.context_limits import prompt_too_long
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.tokenizer import Tokenizer
from temper.tokenizer.renderers import RendererName, build_renderer

_NUM_ALTERNATIVES = 3
"""Most likely tokens shown beside each sampled token with --logprobs."""
RUN_FINAL_WEIGHTS = "checkpoints/*/sampler_weights/final"
"""Where a run directory keeps its final sampler weights (one per process that trained it)."""


def model_directory(model: str) -> Path:
    """The directory `--model` names: as given, or for a run directory its newest final
    sampler weights (a resumed run has one per process; the last written is the run's end)."""
    if model.startswith("tinker://"):
        raise ValueError(
            f"--model {model}: a tinker:// path names a checkpoint inside a storage directory; "
            "give the run directory (temper sample --model RUN_DIR) or the checkpoint's own "
            "directory (RUN_DIR/checkpoints/<run>/sampler_weights/<name>)"
        )
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"--model {model!r} is not a directory")
    is_run = (path / "config.json").is_file() and (path / "checkpoints").is_dir()
    if not is_run or (path / SAMPLER_FILE).is_file():
        return path
    finals = sorted(
        (
            candidate
            for candidate in path.glob(RUN_FINAL_WEIGHTS)
            if (candidate / SAMPLER_FILE).is_file()
        ),
        key=lambda candidate: (candidate / SAMPLER_FILE).stat().st_mtime,
    )
    if not finals:
        raise FileNotFoundError(
            f"--model {model!r} is a run directory without final sampler weights "
            f"({RUN_FINAL_WEIGHTS}): the run has not finished; give a model directory instead"
        )
    print(f"model: {finals[-1]}", file=sys.stderr)
    return finals[-1]


def sample(
    *,
    model: str,
    prompt: str,
    n: Annotated[int | None, tyro.conf.arg(aliases=("-n",))] = None,
    max_tokens: int = 32,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: tuple[str, ...] = (),
    dtype: DType = "float32",
    device: str = "cpu",
    logprobs: bool = False,
    chat: RendererName | None = None,
) -> int:
    """Sample completions of a text prompt from a model directory and print them.

    Args:
        model: HF model directory, a run directory (its final weights), or a run's
            checkpoints/<run>/sampler_weights/<name> (LoRA too).
        prompt: Prompt text, encoded as is (no chat template is applied).
        n: Number of completions; default 4, or 1 with --temperature 0 (greedy completions
            are all alike).
        max_tokens: Most tokens per completion.
        temperature: Sampling temperature; 0 is greedy.
        top_k: Keep the k most likely tokens; -1 keeps all.
        top_p: Keep the smallest set of tokens whose probability reaches p; 1 keeps all.
        seed: Seed for reproducible completions; unset: different ones on every run.
        stop: Stop strings, e.g. --stop "User:" "###"; EOS stops as well.
        dtype: Parameter dtype to load the model in.
        device: Device to run on, e.g. 'cpu' or 'cuda'.
        logprobs: Also print each generated token's logprob and the likeliest alternatives.
        chat: Send --prompt as a user message in this chat format (the renderer a
            conversations run trained with, e.g. role_colon); its end-of-reply stop applies.
    """
    n = (1 if temperature == 0 else 4) if n is None else n
    if n < 1:
        raise ValueError(f"-n must be >= 1, got {n}")
    # Checked before the model loads, so a typo costs nothing.
    params = _sampling_params(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=list(stop) or None,
    )
    base = _load(model, device=device, dtype=dtype)
    context = base.model.config.max_seq_len
    prompt_tokens, params = _prompt_tokens(
        prompt,
        tokenizer=base.tokenizer,
        context=context,
        chat=chat,
        params=params,
        stop=stop,
        max_tokens=max_tokens,
    )
    request = SampleRequest(
        prompt=prompt_tokens,
        params=params,
        num_samples=n,
        topk_sample_logprobs=_NUM_ALTERNATIVES if logprobs else 0,
    )
    engine = SamplerEngine.Config(
        max_batch=n, max_seq_len=min(context, len(prompt_tokens) + max_tokens)
    ).build(model=base.model, tokenizer=base.tokenizer)
    start = time.perf_counter()
    (response,) = engine.generate([request])
    _print_completions(
        response.sequences,
        tokenizer=base.tokenizer,
        prompt=base.tokenizer.decode(prompt_tokens) if chat is not None else prompt,
        num_prompt_tokens=len(prompt_tokens),
        seconds=time.perf_counter() - start,
        logprobs=logprobs,
    )
    return 0


def _sampling_params(**fields: Any) -> SamplingParams:
    """`SamplingParams(**fields)`, its error naming the flag ("--top-p must ...") where it
    names the field ("top_p must ...")."""
    try:
        return SamplingParams(**fields)
    except ValueError as error:
        field, _, rest = str(error).partition(" ")
        raise ValueError(f"--{field.replace('_', '-')} {rest}") from None


def _load(model: str, *, device: str, dtype: DType) -> SamplerWeights | ModelSource:
    """The model (and tokenizer) `--model` names: a run's sampler weights (a HF model, or LoRA
    adapters over a base model), or a HF model directory."""
    directory = model_directory(model)
    if (directory / SAMPLER_FILE).is_file():
        return load_sampler_directory(directory, name=str(directory), device=device, dtype=dtype)
    return ModelSource.Config(path=str(directory), dtype=dtype, device=device).build()


def _prompt_tokens(
    prompt: str,
    *,
    tokenizer: Tokenizer,
    context: int,
    chat: RendererName | None,
    params: SamplingParams,
    stop: tuple[str, ...],
    max_tokens: int,
) -> tuple[list[int], SamplingParams]:
    """The prompt's tokens (through the chat renderer with --chat, which adds its stop), checked
    against the model's context before any work; notes on stderr for unknown pieces and for a
    context that cuts completions short."""
    prompt_tokens = tokenizer.encode(prompt)
    if chat is not None and prompt_tokens:
        renderer = build_renderer(chat, tokenizer=tokenizer)
        prompt_tokens = renderer.generation_prompt([{"role": "user", "content": prompt}])
        params = dataclasses.replace(params, stop=_with_chat_stop(stop, renderer.stop))
    if not prompt_tokens:
        raise ValueError(f"--prompt {prompt!r} encodes to zero tokens; give some text")
    if tokenizer.unk_token_id in prompt_tokens:
        unknown = sorted(set(tokenizer.unknown_pieces(prompt)))
        print(
            f"note: --prompt has text the tokenizer encodes as its unknown token (pieces not in "
            f"the vocabulary: {unknown[:20]})",
            file=sys.stderr,
        )
    if len(prompt_tokens) >= context:
        raise ValueError(
            prompt_too_long(
                "--prompt", num_tokens=len(prompt_tokens), context=context, holder="the model"
            )
        )
    if len(prompt_tokens) + max_tokens > context:
        print(
            f"note: the prompt has {len(prompt_tokens)} tokens and the model's context is "
            f"{context}, so completions stop after at most {context - len(prompt_tokens)} "
            f"tokens, not --max-tokens {max_tokens}",
            file=sys.stderr,
        )
    return prompt_tokens, params


def _with_chat_stop(stop: tuple[str, ...], chat_stop: list[int] | list[str]) -> list:
    """--stop strings and a chat format's own stop (token ids or strings), as one stop list."""
    if not stop:
        return list(chat_stop)
    if chat_stop and not isinstance(chat_stop[0], str):
        raise ValueError(
            f"--stop takes strings, but --chat's format stops at token ids {list(chat_stop)}; "
            "leave out --stop (the format ends its replies itself)"
        )
    return [*stop, *chat_stop]


def _print_completions(
    sequences: list[SampledSequence],
    *,
    tokenizer: Tokenizer,
    prompt: str,
    num_prompt_tokens: int,
    seconds: float,
    logprobs: bool,
) -> None:
    console = rich.console.Console(highlight=False)
    num_tokens = sum(len(sequence.tokens) for sequence in sequences)
    console.print(
        f"prompt: {_escaped(prompt)} ({num_prompt_tokens} tokens); {len(sequences)} "
        f"completion{'s' if len(sequences) != 1 else ''}, {num_tokens} tokens in "
        f"{seconds:.2f} s",
        markup=False,
    )
    for index, sequence in enumerate(sequences):
        title = (
            f"completion {index}: stop reason {sequence.stop_reason}, {len(sequence.tokens)} "
            f"tokens, sum of logprobs {sum(sequence.logprobs):.3f}"
        )
        console.print(rich.rule.Rule(rich.text.Text(title), align="left"))
        console.print(rich.text.Text(tokenizer.decode(sequence.tokens)))
        if logprobs:
            console.print(_token_table(sequence, tokenizer=tokenizer))


def _token_table(sequence: SampledSequence, *, tokenizer: Tokenizer) -> rich.table.Table:
    table = rich.table.Table("#", "id", "token", "logprob", f"top {_NUM_ALTERNATIVES} (logprob)")
    topk = sequence.topk_logprobs or [[] for _ in sequence.tokens]
    for position, (token, logprob, alternatives) in enumerate(
        zip(sequence.tokens, sequence.logprobs, topk, strict=True)
    ):
        shown = "  ".join(
            f"{_escaped(tokenizer.decode([other]))} ({value:.2f})" for other, value in alternatives
        )
        table.add_row(
            str(position),
            str(token),
            rich.text.Text(_escaped(tokenizer.decode([token]))),
            f"{logprob:.3f}",
            rich.text.Text(shown),
        )
    return table


def _escaped(text: str) -> str:
    """`text` in double quotes with newlines and other control characters escaped."""
    return json.dumps(text, ensure_ascii=False)
