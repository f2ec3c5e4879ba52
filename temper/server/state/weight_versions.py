"""The weight versions behind each sequence of an in-flight sampling client, in the request log.

Tinker's responses do not say which saved weights produced a sequence, and the SDK 0.38 reads
samples from a protobuf message with no field for it (unknown fields are dropped), so the
server writes them to the request log instead (`temper.server.requests`, INFO), one line per
finished in-flight sample:

    inflight sample sampler=samp-1a2b.. versions req-9f..-0=3,4 req-9f..-1=4

`req-9f..-0` is the sequence id the SDK gives the sequence (`SampledSequence.sequence_id`);
`3,4` are the policy versions (the trainer's optimizer steps) it was decoded with, oldest
first: two when an in-flight save moved the weights while it decoded.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from temper.api.types import SampleResponse

log = logging.getLogger("temper.server.requests")


def log_weight_versions(
    result: SampleResponse, *, sampling_session_id: str, sequence_ids: Sequence[str]
) -> None:
    """One request-log line for a finished sample whose sequences carry weight versions."""
    versions = [sequence.weight_versions for sequence in result.sequences]
    if all(v is None for v in versions):
        return
    spans = " ".join(
        f"{sequence_id}={','.join(map(str, v or ()))}"
        for sequence_id, v in zip(sequence_ids, versions, strict=True)
    )
    log.info("inflight sample sampler=%s versions %s", sampling_session_id, spans)
