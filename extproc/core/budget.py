"""Retry budget and retry cost: a mass GPU failure must not become a re-prefill storm.

The budget has Envoy's semantics (decision 0023): a re-prefill is admitted while the
re-prefills **in flight** stay within `max(min_retry_concurrency, fraction x requests in
flight)`. A re-prefill is in flight from its admission to its attempt's end, wherever that
end is seen: the gate for an attempt that failed before its first delta, the guard for a
released one (with its request). A request is in flight from the guard's acceptance to the
end of its stream. So a quiet pool always has room for a retry, however many retries an
earlier burst used, and a mass failure adds at most the budget's worth of concurrent
re-prefills to the survivors.

Only re-prefills are counted: a first attempt is never refused by the budget, and neither
is an attempt whose predecessors never reached a replica (decision 0010). Ends are keyed by
id and idempotent; an entry whose end never comes (a bug, a lost callback) is dropped after
`expiry_s`, so a lost end cannot hold the budget forever. Counts are per gateway; gateways
publish theirs to etcd and each decides on the pool-wide sum (a second-old view of the
others, an exact view of itself). Time is passed in (a monotonic clock), so this stays pure.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


class InFlight:
    """Keys in flight, each with its start time and a tag; an entry not ended within
    `expiry_s` of its start is dropped (and counted in `expired`).

    Start times come from one monotonic clock, so entries are in start order and expiry
    only ever looks at the oldest ones.
    """

    def __init__(self, expiry_s: float) -> None:
        self.expiry_s = expiry_s
        self._since: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self.expired = 0  # entries dropped because their end never came

    def start(self, key: str, now: float, tag: str = "") -> bool:
        """Count `key` from `now`; False if it is counted already (nothing changes)."""
        if key in self._since:
            return False
        self._since[key] = (now, tag)
        return True

    def end(self, key: str) -> str | None:
        """Stop counting `key`; its tag, or None if it was not counted (ended, expired)."""
        got = self._since.pop(key, None)
        return got[1] if got is not None else None

    def tag_of(self, key: str) -> str | None:
        got = self._since.get(key)
        return got[1] if got is not None else None

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Drop the entries started `expiry_s` or more ago; (key, tag) of each."""
        cut = now - self.expiry_s
        gone: list[tuple[str, str]] = []
        while self._since:
            key, (since, tag) = next(iter(self._since.items()))
            if since > cut:
                break
            self._since.popitem(last=False)
            gone.append((key, tag))
        self.expired += len(gone)
        return gone

    def __contains__(self, key: object) -> bool:
        return key in self._since

    def __len__(self) -> int:
        return len(self._since)


@dataclass(frozen=True, slots=True)
class BudgetDecision:
    allowed: bool
    retries: int  # re-prefills in flight pool-wide (this one included when allowed)
    requests: int  # requests in flight pool-wide
    limit: int


class RetryBudget:
    def __init__(self, fraction: float, min_retry_concurrency: int, expiry_s: float) -> None:
        self.fraction = fraction
        self.min_retry_concurrency = min_retry_concurrency
        self.requests = InFlight(expiry_s)
        self.retries = InFlight(expiry_s)  # attempt id -> (admitted at, request id)
        self._by_request: dict[str, set[str]] = {}  # request id -> its counted attempt ids
        # Other gateways' latest published counts: gateway id -> (requests, retries) in flight.
        self.others: dict[str, tuple[int, int]] = {}
        self.last: BudgetDecision | None = None  # the latest decision, for metrics

    # --- requests ---------------------------------------------------------------------

    def request_started(self, request_id: str, now: float, run: str = "") -> None:
        """The guard accepted the request (its intake committed); `run` names this run of
        it (the guard's stream), so a later run of the same request id is told apart."""
        self._expire(now)
        self.requests.start(request_id, now, run)

    def request_ended(self, request_id: str, run: str = "") -> None:
        """The run's stream is over, and with it every attempt of it: its re-prefills (the
        released one among them) stop counting too. Idempotent; the end of another run
        of the same request id changes nothing."""
        tag = self.requests.tag_of(request_id)
        if tag is not None and tag != run:
            return
        self.requests.end(request_id)
        for aid in self._by_request.pop(request_id, ()):
            self.retries.end(aid)

    # --- re-prefills ------------------------------------------------------------------

    def try_retry(self, now: float, attempt_id: str, request_id: str) -> BudgetDecision:
        """Admit one re-prefill if the pool-wide budget allows it, and count it if so.

        Asking again for an attempt already counted admits it without counting it twice.
        """
        req, ret = self.snapshot(now)
        req += sum(r for r, _ in self.others.values())
        ret += sum(t for _, t in self.others.values())
        limit = max(self.min_retry_concurrency, int(self.fraction * req))
        if attempt_id in self.retries:
            self.last = BudgetDecision(True, ret, req, limit)
            return self.last
        if ret + 1 > limit:
            self.last = BudgetDecision(False, ret, req, limit)
            return self.last
        self.retries.start(attempt_id, now, request_id)
        self._by_request.setdefault(request_id, set()).add(attempt_id)
        self.last = BudgetDecision(True, ret + 1, req, limit)
        return self.last

    def retry_ended(self, attempt_id: str) -> None:
        """The attempt is over (it failed before its first delta, or was refused after the
        budget admitted it). Idempotent; an attempt that was never counted is ignored."""
        rid = self.retries.end(attempt_id)
        if rid is not None:
            self._forget(rid, attempt_id)

    def _forget(self, request_id: str, attempt_id: str) -> None:
        aids = self._by_request.get(request_id)
        if aids is not None:
            aids.discard(attempt_id)
            if not aids:
                del self._by_request[request_id]

    # --- counts -----------------------------------------------------------------------

    def snapshot(self, now: float) -> tuple[int, int]:
        """This gateway's (requests, re-prefills) in flight: what it publishes."""
        self._expire(now)
        return len(self.requests), len(self.retries)

    def _expire(self, now: float) -> None:
        self.requests.expire(now)
        for aid, rid in self.retries.expire(now):
            self._forget(rid, aid)


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
