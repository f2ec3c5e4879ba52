"""`SamplerEngine.score`: the logprob of every token of whole sequences, in full forwards.

Shapes: B sequences in a batch, T tokens.

A full forward per batch of sequences (as many as fit `max_tokens` padded tokens), through
the same function the trainer uses, so the result equals the trainer's logprobs for the same
batch bitwise. No KV cache is involved.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from temper.models.common.logprobs import forward_logprobs
from temper.sampler.context_limits import prompt_too_long


def score_sequences(
    model: nn.Module,
    sequences: Sequence[Sequence[int]],
    *,
    temperature: float,
    max_tokens: int,
) -> list[torch.Tensor]:
    """Logprob of tokens[1:] of each sequence given the ones before it (fp32 tensors)."""
    vocab_size, device = model.config.vocab_size, next(model.parameters()).device
    for index, sequence in enumerate(sequences):
        check_tokens(
            sequence,
            where=f"sequence {index}",
            vocab_size=vocab_size,
            max_seq_len=model.config.max_seq_len,
        )
    results: list[torch.Tensor] = []
    for batch in _token_budget_batches(sequences, budget=max_tokens):
        width = max(len(sequence) for sequence in batch) - 1
        tokens_BT = torch.zeros((len(batch), width + 1), dtype=torch.long)
        for row, sequence in enumerate(batch):
            tokens_BT[row, : len(sequence)] = torch.tensor(sequence)
        tokens_BT = tokens_BT.to(device)
        logprobs_BT = forward_logprobs(
            model, tokens_BT[:, :-1], tokens_BT[:, 1:], temperature=temperature
        )
        results.extend(logprobs_BT[row, : len(seq) - 1] for row, seq in enumerate(batch))
    return results


def check_tokens(
    tokens: Sequence[int], *, where: str, vocab_size: int, max_seq_len: int, min_len: int = 2
) -> None:
    if len(tokens) < min_len:
        raise ValueError(f"{where}: needs at least {min_len} tokens, got {len(tokens)}")
    if len(tokens) > max_seq_len:
        raise ValueError(
            prompt_too_long(
                where,
                num_tokens=len(tokens),
                context=max_seq_len,
                holder="the model (max_seq_len)",
                new_token=False,
            )
        )
    for position, token in enumerate(tokens):
        if not 0 <= int(token) < vocab_size:
            raise ValueError(
                f"{where}: token {token} at position {position} is outside the vocabulary; "
                f"valid ids are 0..{vocab_size - 1}"
            )


def _token_budget_batches(
    sequences: Sequence[Sequence[int]], *, budget: int
) -> Iterable[list[Sequence[int]]]:
    batch: list[Sequence[int]] = []
    width = 0
    for sequence in sequences:
        new_width = max(width, len(sequence))
        if batch and new_width * (len(batch) + 1) > budget:
            yield batch
            batch, new_width = [], len(sequence)
        batch.append(sequence)
        width = new_width
    if batch:
        yield batch
