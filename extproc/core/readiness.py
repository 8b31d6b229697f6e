"""Readiness from observations of etcd: pure, the clock passed in (decision 0016).

A processor that cannot reach etcd refuses every request (fail closed, decision 0006), so it
must not be counted as ready: readiness is NOT_SERVING until etcd first answered, and again
once etcd has been silent for longer than the grace. The grace keeps one slow answer or a
leader election from flapping the pod out of its Service. Liveness is not decided here: it
never depends on etcd (restarting a processor does not bring etcd back).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Reason(StrEnum):
    NEVER_ANSWERED = "etcd_never_answered"
    ANSWERING = "etcd_answering"
    SILENT = "etcd_silent"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class Verdict:
    ready: bool
    reason: Reason


def decide(last_answer: float | None, now: float, grace_s: float, draining: bool) -> Verdict:
    """Ready iff not draining and etcd answered within the last `grace_s` seconds.

    `last_answer` and `now` are readings of one monotonic clock. An answer stamped after
    `now` (a reading taken on another thread a moment later) counts as age 0.
    """
    if draining:
        return Verdict(False, Reason.DRAINING)
    if last_answer is None:
        return Verdict(False, Reason.NEVER_ANSWERED)
    if now - last_answer > grace_s:
        return Verdict(False, Reason.SILENT)
    return Verdict(True, Reason.ANSWERING)


def probe_after_s(grace_s: float) -> float:
    """How stale the last answer may get before the processor asks etcd itself.

    Traffic and the background calls (the retry-budget exchange once a second, lease
    keep-alives) usually answer first; the probe only fills the gaps, so a healthy etcd is
    confirmed at least twice per grace.
    """
    return grace_s / 2


class Readiness:
    """The readiness of one process: observations in, a verdict out when it changes."""

    def __init__(self, grace_s: float) -> None:
        if grace_s <= 0:
            raise ValueError(f"grace_s must be positive, got {grace_s}")
        self.grace_s = grace_s
        self.last_answer: float | None = None
        self.draining = False
        self.verdict = Verdict(False, Reason.NEVER_ANSWERED)

    def answered(self, at: float) -> None:
        """etcd answered a call at monotonic time `at` (answers may be reported late)."""
        if self.last_answer is None or at > self.last_answer:
            self.last_answer = at

    def drain(self) -> None:
        """Shutting down: not ready from now on, whatever etcd does."""
        self.draining = True

    def age(self, now: float) -> float | None:
        """Seconds since etcd last answered; None if it never has."""
        if self.last_answer is None:
            return None
        return max(0.0, now - self.last_answer)

    def should_probe(self, now: float) -> bool:
        age = self.age(now)
        return not self.draining and (age is None or age >= probe_after_s(self.grace_s))

    def evaluate(self, now: float) -> Verdict | None:
        """The verdict at `now`; returned only when it differs from the previous one."""
        v = decide(self.last_answer, now, self.grace_s, self.draining)
        if v == self.verdict:
            return None
        self.verdict = v
        return v

    def next_change(self, now: float) -> float | None:
        """The latest time at which the verdict flips without any new observation.

        Only a ready process can flip on its own (to SILENT, just after last + grace); the
        caller evaluates again no later than this.
        """
        if self.draining or self.last_answer is None:
            return None
        flip = self.last_answer + self.grace_s
        return flip if flip >= now else None
