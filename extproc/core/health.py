"""Which replicas of a compatible group are worth trying first: the processor's view of health.

Envoy's override_host policy sends attempt n to the n-th host of the list the guard gives
it, whatever Envoy's own health checks say (seen on 1.40.0: a host failing its active
check is still picked when listed). So the guard orders each list itself: hosts known to be
healthy first, in the request's rotation, then the rest by when they may be back. No host
is ever dropped from a list: with every host down the request still gets its attempts (the
same "panic" choice Envoy makes when too few hosts are healthy).

Two kinds of evidence, mirroring Envoy's: passive (how attempts ended, from the gate and
from Envoy's per-attempt access log, like outlier detection's consecutive local-origin
failures) and active (the processor's own probe of each replica's health path). A first-delta
timeout ejects at once, and a replica's own 429/503 with Retry-After marks it busy (tried
after the healthy ones, before the dead) until then (decision 0024). Time is passed in, so
this stays pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# consecutive_failures this large: passive ejection is off (outlier_detection.enabled false).
PASSIVE_OFF = 1 << 30


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    # Passive: this many failed attempts in a row (refused, reset, or silent past the
    # first-delta limit) eject a host ...
    consecutive_failures: int = 2
    # ... for base x (number of ejections so far), capped.
    base_ejection_s: float = 5.0
    max_ejection_s: float = 60.0
    # Active: this many failed probes in a row mark a host down; this many good ones up.
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1


class _Host:
    __slots__ = ("busy_until", "ejected_until", "ejections", "failures", "probe_bad",
                 "probe_down", "probe_good")

    def __init__(self) -> None:
        self.busy_until = 0.0
        self.failures = 0
        self.ejections = 0
        self.ejected_until = 0.0
        self.probe_bad = 0
        self.probe_good = 0
        self.probe_down = False


class HostHealth:
    def __init__(self, policy: HealthPolicy) -> None:
        self.policy = policy
        self._hosts: dict[str, _Host] = {}

    def _h(self, addr: str) -> _Host:
        h = self._hosts.get(addr)
        if h is None:
            h = self._hosts[addr] = _Host()
        return h

    def attempt_failed(self, addr: str, now: float) -> bool:
        """One more failed attempt on `addr`; True if that ejected it."""
        h = self._h(addr)
        h.failures += 1
        if h.failures < self.policy.consecutive_failures or h.ejected_until > now:
            return False
        h.ejections += 1
        h.failures = 0
        p = self.policy
        h.ejected_until = now + min(p.max_ejection_s, p.base_ejection_s * h.ejections)
        return True

    def first_delta_timed_out(self, addr: str, now: float) -> bool:
        """An attempt on `addr` produced no first delta within the limit: ejected at once
        (decision 0024). A frozen host accepts connections and never answers, so every
        request sent there costs a whole first-delta limit; one is evidence enough. A
        good probe brings it back (a slow but alive replica answers its health check)."""
        h = self._h(addr)
        if self.policy.consecutive_failures < PASSIVE_OFF:  # passive ejection is on
            h.failures = max(h.failures, self.policy.consecutive_failures - 1)
        return self.attempt_failed(addr, now)

    def overloaded(self, addr: str, until: float) -> None:
        """The replica answered 429/503 with Retry-After: busy until then. Not dead (a slow
        replica is not a dead one): it stays ahead of hosts known to be down."""
        h = self._h(addr)
        h.busy_until = max(h.busy_until, until)

    def busy(self, addr: str, now: float) -> bool:
        h = self._hosts.get(addr)
        return h is not None and h.busy_until > now

    def attempt_succeeded(self, addr: str, now: float) -> None:
        h = self._h(addr)
        h.failures = 0
        if h.ejected_until <= now:
            h.ejections = 0

    def probed(self, addr: str, ok: bool, now: float) -> None:
        h = self._h(addr)
        p = self.policy
        if ok:
            h.probe_good += 1
            h.probe_bad = 0
            if h.probe_good >= p.healthy_threshold:
                # A host whose probe answers is tried again at once (a restarted pod), as
                # Envoy un-ejects a host on a successful active check by default.
                h.probe_down = False
                h.ejected_until = 0.0
                h.failures = 0
        else:
            h.probe_bad += 1
            h.probe_good = 0
            if h.probe_bad >= p.unhealthy_threshold:
                h.probe_down = True

    def healthy(self, addr: str, now: float) -> bool:
        h = self._hosts.get(addr)
        return h is None or (not h.probe_down and h.ejected_until <= now)

    def order(self, hosts: Sequence[str], now: float) -> list[str]:
        """Healthy hosts first, in the given order; then busy ones (a Retry-After not yet
        over), soonest free first; then the unhealthy, soonest back first."""
        good = [a for a in hosts if self.healthy(a, now) and not self.busy(a, now)]
        if len(good) == len(hosts):
            return list(hosts)
        busy = [a for a in hosts if self.healthy(a, now) and self.busy(a, now)]
        busy.sort(key=lambda a: self._h(a).busy_until)
        bad = [a for a in hosts if not self.healthy(a, now)]
        bad.sort(key=lambda a: (self._h(a).probe_down, self._h(a).ejected_until))
        return good + busy + bad

    def unhealthy(self, hosts: Iterable[str], now: float) -> list[str]:
        return [a for a in hosts if not self.healthy(a, now)]
