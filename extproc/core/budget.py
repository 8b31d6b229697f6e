"""Retry budget and retry cost: a mass GPU failure must not become a re-prefill storm.

The budget admits a re-prefill only while re-prefills stay below `fraction` of requests
over the last `window_s`, with a floor of `min_retries` per window so a quiet pool can
still fail over: Envoy's retry-budget shape (`budget_percent`, `min_retry_concurrency`)
over Finagle's time window instead of in-flight counts. Only re-prefills are counted: a
first attempt is never refused by the budget, and neither is an attempt whose predecessors
never reached a replica (decision 0010). Counts are per gateway; gateways publish theirs to
etcd and each decides on the pool-wide sum (a second-old view of the others, an exact view
of itself). Time is passed in, so this stays pure.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any


class WindowCounter:
    """Events in the last `window_s` seconds (timestamps passed in)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._ts: deque[float] = deque()

    def add(self, now: float) -> None:
        self._ts.append(now)

    def count(self, now: float) -> int:
        cut = now - self.window_s
        while self._ts and self._ts[0] < cut:
            self._ts.popleft()
        return len(self._ts)


@dataclass(frozen=True, slots=True)
class BudgetDecision:
    allowed: bool
    retries: int
    requests: int
    limit: int


class RetryBudget:
    def __init__(self, fraction: float, min_retries: int, window_s: float) -> None:
        self.fraction = fraction
        self.min_retries = min_retries
        self.requests = WindowCounter(window_s)
        self.retries = WindowCounter(window_s)
        # Other gateways' latest published counts: gateway id -> (requests, retries).
        self.others: dict[str, tuple[int, int]] = {}
        self.last: BudgetDecision | None = None  # the latest decision, for metrics

    def note_request(self, now: float) -> None:
        self.requests.add(now)

    def try_retry(self, now: float) -> BudgetDecision:
        """Admit one retry if the pool-wide budget allows it, and count it if so."""
        req = self.requests.count(now) + sum(r for r, _ in self.others.values())
        ret = self.retries.count(now) + sum(t for _, t in self.others.values())
        limit = max(self.min_retries, int(self.fraction * req))
        if ret + 1 > limit:
            self.last = BudgetDecision(False, ret, req, limit)
            return self.last
        self.retries.add(now)
        self.last = BudgetDecision(True, ret + 1, req, limit)
        return self.last

    def snapshot(self, now: float) -> tuple[int, int]:
        return self.requests.count(now), self.retries.count(now)


def estimate_prompt_tokens(body: Any, chars_per_token: float) -> int:
    """A tokenizer-free estimate: characters of the prompt text / chars_per_token.

    English BPE tokenizers average ~4 characters per token; code and non-Latin scripts run
    lower (more tokens), so the estimate errs low for them: set chars_per_token lower for
    such traffic. Message framing adds ~4 tokens per chat message.
    """
    chars = 0
    messages = 0
    if isinstance(body, dict):
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                messages += 1
                c = m.get("content")
                if isinstance(c, str):
                    chars += len(c)
                elif isinstance(c, list):
                    chars += sum(len(p.get("text", "")) for p in c
                                 if isinstance(p, dict) and isinstance(p.get("text"), str))
        p = body.get("prompt")
        if isinstance(p, str):
            chars += len(p)
        elif isinstance(p, list):
            chars += sum(len(x) for x in p if isinstance(x, str))
    return int(chars / chars_per_token) + 4 * messages
