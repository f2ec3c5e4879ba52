"""The one wording of a prompt too long for a context, on every surface that refuses one: the
server's validation, the sampling engines (Temper's and vLLM's) behind the in-process clients,
whole-sequence scoring, and `temper sample`."""

from __future__ import annotations


def prompt_too_long(
    where: str, *, num_tokens: int, context: int, holder: str, new_token: bool = True
) -> str:
    """`where`: the verb the user called and what was too long ('compute_logprobs: prompt',
    'request 2: prompt', '--prompt'); `holder`: whose context of `context` tokens it is
    ('the sampler (max_seq_len)'). A prompt to sample from leaves room for one new token
    (`new_token`); a sequence scored whole may fill the context."""
    if new_token:
        return (
            f"{where} has {num_tokens} tokens; {holder} holds at most {context} tokens "
            f"(prompt + completion), so a prompt may have at most {context - 1}"
        )
    return f"{where} has {num_tokens} tokens; {holder} holds at most {context} tokens"
