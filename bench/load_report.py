"""The figures of bench/server_load.py from its clients' call records: per phase (the whole
run, or before and after a generator rank's kill), per SDK verb: calls/s, sampled tokens/s,
p50/p99 latency; failed attempts by kind; calls past their deadline; calls held at the kill;
and the checks the bench states (0 errors, no hang, health answered, other users answered).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from load_client import is_retryable

VERB_ORDER = ("save_weights_and_get_sampling_client", "sample", "forward_backward", "optim_step")


@dataclass
class Call:
    """One SDK call: its attempts (the first and the retries) as the client reported them."""

    client: int
    verb: str
    attempts: list[dict] = field(default_factory=list)

    @property
    def start(self) -> float:
        return self.attempts[0]["start"]

    @property
    def end(self) -> float:
        return self.attempts[-1]["end"]

    @property
    def ok(self) -> bool:
        return self.attempts[-1]["ok"]

    @property
    def failed_kinds(self) -> list[str]:
        return [attempt["kind"] for attempt in self.attempts if not attempt["ok"]]


def calls_of(client: int, events: list[dict]) -> list[Call]:
    """A client's attempts grouped into calls (attempt 0 opens a call; retries follow it)."""
    calls: list[Call] = []
    for event in events:
        if event["attempt"] == 0:
            calls.append(Call(client, event["verb"]))
        calls[-1].attempts.append(event)
    return calls


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def phase_figures(calls: list[Call], *, seconds: float) -> dict:
    """Per verb throughput and latency of a phase's calls, and its failures.

    Latency is the successful attempt's (a retried call's last attempt); calls/s counts calls
    that succeeded; `errors` counts calls that failed for good (their last attempt failed)."""
    verbs: dict[str, dict] = {}
    rank = {verb: index for index, verb in enumerate(VERB_ORDER)}
    order = sorted({call.verb for call in calls}, key=lambda v: (rank.get(v, len(rank)), v))
    for verb in order:
        ok = [call for call in calls if call.verb == verb and call.ok]
        latencies_ms = [1000 * (c.attempts[-1]["end"] - c.attempts[-1]["start"]) for c in ok]
        figures = {
            "calls": len(ok),
            "calls_per_s": round(len(ok) / seconds, 2),
            "p50_ms": round(percentile(latencies_ms, 0.5), 1) if ok else None,
            "p99_ms": round(percentile(latencies_ms, 0.99), 1) if ok else None,
        }
        if verb == "sample":
            tokens = sum(call.attempts[-1]["tokens"] for call in ok)
            figures["tokens_per_s"] = round(tokens / seconds, 1)
        verbs[verb] = figures
    kinds = Counter(kind for call in calls for kind in call.failed_kinds)
    return {
        "seconds": round(seconds, 2),
        "verbs": verbs,
        "errors": sum(not call.ok for call in calls),
        "errors_by_verb": dict(Counter(call.verb for call in calls if not call.ok)),
        "failed_attempts_by_kind": dict(sorted(kinds.items())),
        "past_deadline": kinds["deadline"],
        "retried_ok": sum(call.ok and len(call.attempts) > 1 for call in calls),
        "first_error": next(
            (
                f"{call.verb}: {attempt['detail']}"
                for call in calls
                for attempt in call.attempts
                if not attempt["ok"]
            ),
            None,
        ),
    }


def held_at_kill(calls: list[Call]) -> dict:
    """The calls in flight when the rank died (started before, ended after): how each ended."""
    kinds = Counter(kind for call in calls for kind in call.failed_kinds)
    return {
        "calls": len(calls),
        "ok_first_try": sum(len(call.attempts) == 1 and call.ok for call in calls),
        "ok_on_retry": sum(len(call.attempts) > 1 and call.ok for call in calls),
        "failed": sum(not call.ok for call in calls),
        "failed_attempts_by_kind": dict(sorted(kinds.items())),
        "past_deadline": kinds["deadline"],
    }


def healthz_figures(polls: list[tuple[float, bool, float]]) -> dict:
    """(time, answered, ms) polls: how many, how many answered, the slowest answer."""
    answered_ms = [ms for _, answered, ms in polls if answered]
    return {
        "polls": len(polls),
        "answered": len(answered_ms),
        "max_ms": round(max(answered_ms), 1) if answered_ms else None,
    }


def checks(phases: dict, healthz: dict, *, held: dict | None, setup_failures: int) -> dict:
    """What the bench states, each true or false. Without a kill (`held` None): no call
    failed, none passed its deadline, every health probe answered. With one: no call failed
    before it; the calls held at the kill and those after it failed, if at all, with a
    retryable kind; no call passed its deadline; health kept answering; and every verb
    answered before the kill was answered after it."""
    first = phases["all"] if held is None else phases["before_kill"]
    deadline_misses = sum(p["past_deadline"] for p in phases.values())
    result = {
        "no_setup_failures": setup_failures == 0,
        "no_errors" + ("" if held is None else "_before_kill"): first["errors"] == 0,
        "no_call_past_deadline": deadline_misses + (held or {}).get("past_deadline", 0) == 0,
        "healthz_answered": all(h["answered"] == h["polls"] > 0 for h in healthz.values()),
    }
    if held is not None:
        after = phases["after_kill"]
        result["others_answered_after_kill"] = all(
            after["verbs"].get(verb, {}).get("calls", 0) > 0 for verb in first["verbs"]
        )
        kinds = [*held["failed_attempts_by_kind"], *after["failed_attempts_by_kind"]]
        result["failures_at_and_after_kill_retryable"] = all(is_retryable(k) for k in kinds)
    return result
