"""preStop of the processor container: drain Envoy, stop it, then let the processor go.

Runs in the processor container (it has Python; the Envoy image may have no HTTP client,
and Envoy's admin wants POST for these endpoints). Both containers share the pod's network,
so Envoy's admin is on 127.0.0.1.

  1. POST /healthcheck/fail: Envoy's /ready turns 503 (DRAINING), so the pod leaves the
     Service's endpoints, and the connection manager closes keep-alive connections after
     their current response instead of taking new requests on them.
  2. Wait --drain-seconds: endpoint removal travels to kube-proxy and load balancers; a
     request that still arrives meanwhile is served normally.
  3. Wait until no downstream request is active (http.ingress.downstream_rq_active == 0),
     at most --max-stream-seconds: streams that started before the drain finish whole.
  4. POST /quitquitquit: Envoy exits (a stream still open at the deadline is cut; the
     processor is still up, so its journal outcome is written).
  5. Wait --linger-seconds: the last access-log entries and outcomes reach etcd.
Then this hook returns and the kubelet sends the processor SIGTERM: always after Envoy.

Never raises: an unreachable admin (Envoy already gone) just shortens the steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

ACTIVE = "http.ingress.downstream_rq_active"


def _log(msg: str) -> None:
    print(json.dumps({"ts": time.time(), "msg": "drain: " + msg}), file=sys.stderr, flush=True)


def _admin(base: str, path: str, method: str = "GET", timeout: float = 2.0) -> str | None:
    req = urllib.request.Request(base + path, method=method, data=b"" if method == "POST"
                                 else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return str(r.read().decode())
    except (urllib.error.URLError, OSError) as e:
        _log(f"{method} {path}: {e}")
        return None


def active_requests(base: str) -> int | None:
    body = _admin(base, f"/stats?format=json&filter=^{ACTIVE}$")
    if body is None:
        return None
    try:
        for s in json.loads(body).get("stats", []):
            if s.get("name") == ACTIVE:
                return int(s.get("value", 0))
    except (ValueError, AttributeError):
        return None
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--admin", default="127.0.0.1:9901")
    ap.add_argument("--drain-seconds", type=float, default=10.0)
    ap.add_argument("--max-stream-seconds", type=float, default=300.0)
    ap.add_argument("--linger-seconds", type=float, default=3.0)
    ap.add_argument("--poll-seconds", type=float, default=1.0)
    a = ap.parse_args(argv)
    base = "http://" + a.admin
    t0 = time.monotonic()
    alive = _admin(base, "/healthcheck/fail", "POST") is not None
    _log(f"health failed (envoy reachable: {alive}); draining {a.drain_seconds}s")
    if alive:
        time.sleep(a.drain_seconds)
        deadline = time.monotonic() + a.max_stream_seconds
        while True:
            n = active_requests(base)
            if n is None or n == 0:
                break
            if time.monotonic() >= deadline:
                _log(f"{n} request(s) still active after {a.max_stream_seconds}s: stopping anyway")
                break
            time.sleep(a.poll_seconds)
        _admin(base, "/quitquitquit", "POST")
        _log(f"envoy stopped after {time.monotonic() - t0:.1f}s")
    time.sleep(a.linger_seconds)
    _log("processor may stop now")
    return 0


if __name__ == "__main__":
    sys.exit(main())
