"""Constants and small fakes shared by the hermetic adapter tests."""

from __future__ import annotations

import asyncio

from extproc.adapters.timers import FakeClock, FakeTimers

__all__ = ["RID", "SSE_CONTENT", "SSE_DONE", "SSE_ROLE", "FakeClock", "FakeTimers",
           "FixedIds", "idle"]

RID = "req_0123456789abcdefghjkmnpqrs"
SSE_ROLE = (b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
            b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n')
SSE_CONTENT = (b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
               b'"delta":{"content":"tok"},"finish_reason":null}]}\n\n')
SSE_DONE = b"data: [DONE]\n\n"


class FixedIds:
    """Deterministic ids: att_test_1, att_test_2, ...; request ids req_000...1, ..."""

    def __init__(self) -> None:
        self.n = 0
        self.secrets = 0  # counted apart, so the ids stay what they were
        self.requests = 0

    def request_id(self) -> str:
        """Shaped as the gateway mints them (ULID layout), counted apart from attempt ids."""
        self.requests += 1
        return f"req_{self.requests:026d}"

    def attempt_id(self) -> str:
        self.n += 1
        return f"att_test_{self.n}"

    def attempt_secret(self) -> str:
        """Shaped as the gateway mints them (43 url-safe characters): secret_test_1_xxx..."""
        self.secrets += 1
        return f"secret_test_{self.secrets}_".ljust(43, "x")

    def instance_id(self) -> str:
        return "proc_test"



async def idle(turns: int = 50) -> None:
    """Let every task that can run, run (no time passes): what a test checks after this did
    not happen for want of a turn of the loop."""
    for _ in range(turns):
        await asyncio.sleep(0)
