"""Drive a gate machine through its admission rows (shared by the core tests)."""

from __future__ import annotations

from extproc.core.admission import Admitted
from extproc.core.events import (
    Action,
    AdmissionDecided,
    AdmitDecided,
    IntakeCommitted,
    RequestStarted,
)
from extproc.core.gate import GateMachine

ADMITTED = Admitted(counts_as_retry=False, fence_wait_s=5.0, deadline_s=30.0, final=False)
FINAL = Admitted(counts_as_retry=False, fence_wait_s=5.0, deadline_s=30.0, final=True)


def admit(m: GateMachine, attempt: int = 1, family: str = "chat",
          verdict: Admitted = ADMITTED, preadmitted: bool = False,
          accepted_at: float | None = None) -> list[Action]:
    """RequestStarted, the intake committed, admitted, the journal's yes: the actions of
    the last step (the machine is then in gate_forwarded)."""
    m.handle(RequestStarted(attempt, family, attempt_id=f"att_{attempt}",
                            preadmitted=preadmitted, accepted_at=accepted_at))
    m.handle(IntakeCommitted())
    m.handle(AdmissionDecided(verdict))
    return m.handle(AdmitDecided(True))
