"""Pool availability: healthy traffic while a replica or an etcd member fails.

    .venv/bin/python -m bench.pool             # both sides, every fault, ~4 min
    .venv/bin/python -m bench.pool --requests 120 --concurrency 8
    .venv/bin/python -m bench.pool --faults etcd-leader,etcd-frozen,etcd-quorum

Two sides measured back to back in the same run, on the same Envoy config: plain (Envoy
alone, with the same health checks, outlier detection and retry policy) and ours (Envoy +
processor + etcd). Three demo replicas; `timeouts.first_delta_s` is shortened to FIRST so
the bounds are seconds (everything else is the default policy: retry budget, pool health,
first-delta budget, etcd timeouts). Every case runs on a fresh stack.

Replica faults: N healthy requests (no fault header), C at a time, while replica r2 is
SIGKILLed and kept down ("dead") or SIGSTOPped ("frozen": the kernel still accepts its
connections), or both at once ("two-down": r2 dead and r3 frozen, one healthy replica left;
decision 0024). `--panic P` renders pool.healthy_panic_threshold P on both sides (the
comparison in decision 0024).

etcd faults (decision 0026): ours runs on a 3-member etcd, the processor given every
member (its first endpoint, the one it uses, is the member named `etcd`). Plain Envoy has no
processor, so etcd does not matter to it: its row is the ceiling, under the same load. The
N requests (half with an Idempotency-Key) are paced evenly over the fault's window, C at a
time: the fault starts LEAD seconds in, and the last request starts TAIL seconds after it
ends.
  etcd-leader   the leader is SIGKILLed, started again LEADER_DOWN_S later (rejoins);
  etcd-frozen   the processor's member is SIGSTOPped for HOLD_S seconds;
  etcd-quorum   two members of three are SIGKILLed for HOLD_S seconds, then started again.
For ours, every request id is then looked up (`GET /v1/requests/<id>`) until it has an
outcome or SETTLE_S after the fault ended: a record without an outcome then is unsettled
(404 is a record whose intake was taken back, decision 0026). In etcd-quorum, the requests
that started while quorum was lost should get a clean `503 journal_unavailable` with a
request id (the worst time to it is printed), and each keyed one that did not complete is
sent again with its key SETTLE_S after the restore (in the other etcd cases too, when one
did not complete): still `409 request_in_progress` is a key stuck for good.

A request counts as complete only with HTTP 200, every expected content event, `[DONE]` and
no error event; anything else is counted by what the client saw. Prints, per side and
fault: the share of complete requests, the worst and median wait, and ours / plain; for
the etcd faults, a line of what happened during the fault. Bounded: N requests per case,
each with a 30 s client timeout; every process is stopped by PID with its stack.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # `python bench/pool.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from devkit.devstack import Stack

FIRST = 3.0
MAX_TOKENS = 16
CONFIG: dict[str, Any] = {"timeouts": {"first_delta_s": FIRST, "soft_first_delta_s": 1.0,
                                       "stall_after_first_delta_s": 2.0}}
REPLICA_FAULTS = ("dead", "frozen", "two-down")
ETCD_FAULTS = ("etcd-leader", "etcd-frozen", "etcd-quorum")
FAULTS = REPLICA_FAULTS + ETCD_FAULTS
SIDES = ("plain", "ours")
LEAD = 1.0           # etcd faults: load before the fault starts, s
HOLD_S = 5.0         # etcd-frozen, etcd-quorum: how long the fault lasts, s
LEADER_DOWN_S = 3.0  # etcd-leader: the old leader is started again this long after its kill
TAIL = 1.5           # the last request starts this long after the fault ended, s
SETTLE_S = 10.0      # records looked up, and keys repeated, until this long after it ended
BODY: dict[str, Any] = {"model": "demo-model", "stream": True, "max_tokens": MAX_TOKENS,
                        "seed": 7, "messages": [{"role": "user", "content": "pool availability"}]}


def _one(base: str, key: str | None = None) -> dict[str, Any]:
    headers = {"Idempotency-Key": key} if key else {}
    t = time.monotonic()
    status, raw, err, rid = 0, b"", None, ""
    try:
        with httpx.Client(base_url=base, timeout=30) as c, \
                c.stream("POST", "/v1/chat/completions", json=BODY, headers=headers) as r:
            status = r.status_code
            rid = r.headers.get("x-gateway-request-id", "")
            for chunk in r.iter_raw():
                raw += chunk
    except httpx.HTTPError as e:
        err = type(e).__name__
    took = time.monotonic() - t
    contents = raw.count(b'"delta":{"content":"')
    complete = (status == 200 and err is None and contents == MAX_TOKENS
                and b"data: [DONE]" in raw and b'data: {"error"' not in raw)
    code, body_rid = None, ""
    if not complete:
        try:
            eb = json.loads(raw).get("error", {}) if status != 200 else {}
            code, body_rid = eb.get("code"), eb.get("request_id") or ""
        except (ValueError, AttributeError):
            code = None
        if code is None and b'data: {"error"' in raw:
            code = "in-band error"
    return {"complete": complete, "took_s": took, "status": status, "error": err,
            "code": code, "request_id": rid or body_rid, "body_request_id": body_rid,
            "key": key}


def _summary(side: str, fault: str, n: int, conc: int, rows: list[dict[str, Any]],
             wall: float) -> dict[str, Any]:
    took = sorted(r["took_s"] for r in rows)
    failures: dict[str, int] = {}
    for r in rows:
        if not r["complete"]:
            k = r["code"] or r["error"] or f"http {r['status']}"
            failures[k] = failures.get(k, 0) + 1
    return {"side": side, "fault": fault, "requests": n, "concurrency": conc,
            "complete": sum(1 for r in rows if r["complete"]),
            "share": sum(1 for r in rows if r["complete"]) / max(1, n),
            "worst_s": took[-1], "p50_s": statistics.median(took),
            "p99_s": took[min(len(took) - 1, int(0.99 * len(took)))],
            "wall_s": wall, "failures": failures}


def scenario(side: str, fault: str, n: int, conc: int, work: Path,
             pool: dict[str, Any] | None = None) -> dict[str, Any]:
    if fault in ETCD_FAULTS:
        return etcd_scenario(side, fault, n, conc, work, pool)
    config = {**CONFIG, "pool": pool} if pool else CONFIG
    st = Stack(workdir=work / f"{side}-{fault}", config=config, replicas=3,
               plain=side == "plain").start()
    try:
        st.wait_replicas_healthy()
        time.sleep(2.5)  # Envoy's health checks have seen every replica healthy
        if fault in ("dead", "two-down"):
            st.hold_down("r2")
        if fault == "frozen":
            st.freeze("r2")
        if fault == "two-down":
            st.freeze("r3")
        lock = threading.Lock()
        rows: list[dict[str, Any]] = []

        def run(_: int) -> None:
            r = _one(st.base_url)
            with lock:
                rows.append(r)

        t0 = time.monotonic()
        with ThreadPoolExecutor(conc) as ex:
            list(ex.map(run, range(n)))
        wall = time.monotonic() - t0
    finally:
        if fault == "frozen":
            st.thaw("r2")
        if fault == "two-down":
            st.thaw("r3")
        st.release("r2")
        st.stop()
    return _summary(side, fault, n, conc, rows, wall)


def _lookup(base: str, rid: str) -> tuple[int, dict[str, Any]]:
    try:
        r = httpx.get(f"{base}/v1/requests/{rid}", timeout=5)
    except httpx.HTTPError:
        return 0, {}
    try:
        j = r.json()
    except ValueError:
        j = {}
    return r.status_code, j if isinstance(j, dict) else {}


def _settle(base: str, rows: list[dict[str, Any]], until: float) -> dict[str, int]:
    """Each request's record, polled until it has an outcome, is gone (404), or `until`."""
    counts = {"outcome": 0, "gone (404)": 0, "no outcome": 0, "lookup failed": 0,
              "no request id": 0}
    for r in rows:
        if not r["request_id"]:
            counts["no request id"] += 1
            continue
        while True:
            status, j = _lookup(base, r["request_id"])
            if status == 200 and j.get("outcome") is not None:
                counts["outcome"] += 1
                break
            if status == 404:
                counts["gone (404)"] += 1
                break
            if time.monotonic() >= until:
                counts["no outcome" if status == 200 else "lookup failed"] += 1
                break
            time.sleep(0.1)
    return counts


def etcd_scenario(side: str, fault: str, n: int, conc: int, work: Path,
                  pool: dict[str, Any] | None = None) -> dict[str, Any]:
    """N paced requests (odd ones keyed) across one etcd fault; see the module doc."""
    config = {**CONFIG, "pool": pool} if pool else CONFIG
    plain = side == "plain"
    st = Stack(workdir=work / f"{side}-{fault}", config=config, replicas=3, plain=plain,
               etcd_members=3).start()
    hold = LEADER_DOWN_S if fault == "etcd-leader" else HOLD_S
    gap = (LEAD + hold + TAIL) / max(1, n - 1)
    info: dict[str, Any] = {}
    frozen: list[str] = []
    lost: list[str] = []
    killed = ""
    try:
        st.wait_replicas_healthy()
        time.sleep(2.5)  # Envoy's health checks have seen every replica healthy
        if not plain:
            st.wait_etcd_healthy()
            st.wait_etcd_leader()
        lock = threading.Lock()
        rows: list[dict[str, Any]] = []

        def run(i: int) -> None:
            left = t0 + i * gap - time.monotonic()
            if left > 0:
                time.sleep(left)
            started = time.monotonic() - t0
            r = _one(st.base_url, f"pool-{fault}-{i}-{time.time_ns()}" if i % 2 else None)
            r["started_s"] = started
            with lock:
                rows.append(r)

        t0 = time.monotonic()
        with ThreadPoolExecutor(conc) as ex:
            futures = [ex.submit(run, i) for i in range(n)]
            time.sleep(max(0.0, t0 + LEAD - time.monotonic()))
            start = time.monotonic() - t0
            if not plain and fault == "etcd-leader":
                killed = st.wait_etcd_leader()
                st.kill_etcd_member(killed)
                info["killed"] = killed
                info["new_leader"] = st.wait_etcd_leader(other_than=killed)
                info["election_s"] = time.monotonic() - t0 - start
            elif not plain and fault == "etcd-frozen":
                frozen = [st.etcd_member_names()[0]]
                st.freeze_etcd_member(frozen[0])
                info["frozen"] = frozen[0]
            elif not plain and fault == "etcd-quorum":
                lost = st.lose_etcd_quorum()
                info["killed"] = lost
            time.sleep(max(0.0, t0 + LEAD + hold - time.monotonic()))
            if not plain and fault == "etcd-leader":
                st.restart_etcd_member(killed)
                killed = ""
            elif not plain and fault == "etcd-frozen":
                st.thaw_etcd_member(frozen[0])
                frozen = []
            elif not plain and fault == "etcd-quorum":
                st.restore_etcd_quorum(lost)
                lost = []
            end = time.monotonic() - t0
            for f in futures:
                f.result()
        wall = time.monotonic() - t0
        info.update(fault_start_s=start, fault_end_s=end)
        during = [r for r in rows if start <= r["started_s"] < end]
        info["during"] = len(during)
        info["during_complete"] = sum(1 for r in during if r["complete"])
        if not plain:
            clean = [r for r in during if r["status"] == 503
                     and r["code"] == "journal_unavailable" and r["body_request_id"]]
            info["clean_errors"] = len(clean)
            info["worst_to_error_s"] = max((r["took_s"] for r in clean), default=None)
            info["records"] = _settle(st.base_url, rows, t0 + end + SETTLE_S)
            keyed_failed = [r for r in rows if r["key"] and not r["complete"]]
            if fault == "etcd-quorum" or keyed_failed:
                time.sleep(max(0.0, t0 + end + SETTLE_S - time.monotonic()))
                repeats: dict[str, int] = {}
                for r in keyed_failed:
                    again = _one(st.base_url, r["key"])
                    k = "complete" if again["complete"] else (
                        again["code"] or again["error"] or f"http {again['status']}")
                    repeats[k] = repeats.get(k, 0) + 1
                info["repeats"] = repeats
    finally:
        if frozen:
            st.thaw_etcd_member(frozen[0])
        st.stop()
    out = _summary(side, fault, n, conc, rows, wall)
    out["etcd"] = info
    return out


def measure(n: int = 60, conc: int = 4, log: Any = None,
            faults: tuple[str, ...] = FAULTS, pool: dict[str, Any] | None = None
            ) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-pool-") as d:
        for fault in faults:
            for side in SIDES:
                if log:
                    log(f"pool availability: {side}, {fault} ...")
                out.append(scenario(side, fault, n, conc, Path(d), pool))
    return out


def _etcd_line(fault: str, o: dict[str, Any], p: dict[str, Any]) -> list[str]:
    e, pe = o.get("etcd") or {}, p.get("etcd") or {}
    if not e:
        return []
    pad = " " * 13
    what = {"etcd-leader": f"leader {e.get('killed')} killed at {e['fault_start_s']:.1f} s, "
                           f"{e.get('new_leader')} led {e.get('election_s', 0):.2f} s later, "
                           f"restarted at {e['fault_end_s']:.1f} s",
            "etcd-frozen": f"{e.get('frozen')} (the processor's) frozen "
                           f"{e['fault_start_s']:.1f}-{e['fault_end_s']:.1f} s",
            "etcd-quorum": f"{' and '.join(e.get('killed') or [])} killed "
                           f"{e['fault_start_s']:.1f}-{e['fault_end_s']:.1f} s "
                           f"(back and healthy)"}[fault]
    lines = [f"{pad}{what}; started during it: ours {e['during_complete']}/{e['during']} "
             f"complete, plain {pe.get('during_complete', 0)}/{pe.get('during', 0)}"]
    if fault == "etcd-quorum":
        worst = e.get("worst_to_error_s")
        lines.append(f"{pad}clean 503 journal_unavailable with a request id: "
                     f"{e.get('clean_errors', 0)} of {e['during'] - e['during_complete']} "
                     f"not complete, worst time to it "
                     f"{'-' if worst is None else f'{worst:.2f} s'}")
    rec = e.get("records") or {}
    lines.append(f"{pad}records {SETTLE_S:g} s after the fault: "
                 + ", ".join(f"{k} {v}" for k, v in rec.items() if v or k == "no outcome"))
    if "repeats" in e:
        rep = e["repeats"]
        got = ", ".join(f"{k} {v}" for k, v in rep.items()) or "-"
        lines.append(f"{pad}keyed and not complete, repeated {SETTLE_S:g} s after the fault: "
                     f"{sum(rep.values())} ({got}), still request_in_progress: "
                     f"{rep.get('request_in_progress', 0)}")
    return lines


def table(rows: list[dict[str, Any]]) -> str:
    by = {(r["side"], r["fault"]): r for r in rows}
    n, c = rows[0]["requests"], rows[0]["concurrency"]
    lines = [f"pool availability: 3 demo replicas, {n} healthy requests, {c} at a time, "
             f"first_delta_s {FIRST:g} (bound: 2 x first_delta_s + margin)",
             f"{'fault':<12} {'side':<6} {'complete':>10} {'share':>7} {'p50 s':>7} "
             f"{'p99 s':>7} {'worst s':>8}  failures",
             "-" * 82]
    for fault in dict.fromkeys(r["fault"] for r in rows):
        for side in SIDES:
            r = by[(side, fault)]
            lines.append(f"{fault:<12} {side:<6} {r['complete']:>5}/{r['requests']:<4} "
                         f"{r['share']:>7.1%} {r['p50_s']:>7.2f} {r['p99_s']:>7.2f} "
                         f"{r['worst_s']:>8.2f}  {r['failures'] or '-'}")
        o, p = by[("ours", fault)], by[("plain", fault)]
        lines.append(f"{'':<12} ours / plain: complete x{o['share'] / max(p['share'], 1e-9):.2f}, "
                     f"worst wait x{o['worst_s'] / max(p['worst_s'], 1e-9):.2f}")
        lines += _etcd_line(fault, o, p)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pool", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--faults", default=",".join(FAULTS),
                    help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--panic", type=float, default=None,
                    help="pool.healthy_panic_threshold for both sides (default: the config's)")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    faults = tuple(f for f in a.faults.split(",") if f in FAULTS) or FAULTS
    pool = None if a.panic is None else {"healthy_panic_threshold": max(0.0, min(a.panic, 100.0))}
    rows = measure(max(4, min(a.requests, 2000)), max(1, min(a.concurrency, 64)),
                   lambda m: print(m, file=sys.stderr, flush=True), faults, pool)
    print(table(rows))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
