"""What one open guard stream holds in the processor, by type and by allocation site.

    .venv/bin/python -m bench.census                  # 2,000 then 4,000 streams open
    .venv/bin/python -m bench.census --streams 1000 --top 40

The processor is started as `bench.streams` starts it, with a small `sitecustomize` on its
path that, when the driver asks (a file in a scratch directory), starts tracemalloc (12
frames; after the warm-up, since tracing from startup slows the imports past the devstack's
wait) or runs `gc.collect()` and then counts, inside the processor:
every gc-tracked object by type (count, `sys.getsizeof`), the untracked objects those refer
to (strings, bytes, numbers, untracked tuples) by type, and a tracemalloc snapshot. The
driver opens N guard streams in the bench's state (`bench.streams.MESSAGES`), takes a
census, opens N more, takes another, and prints the difference over N: what each further
open stream holds. Allocation sites are grouped by the innermost frame and by the
innermost frame in the project's own code (`extproc/`), so an object a library allocates
on the project's behalf is charged to the line that asked for it.

The script runs on older trees too (it only needs `bench.streams` and the devstack), so
the same census can be taken on a detached worktree of an earlier commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench import streams

try:
    from devkit.devstack import Stack
except ImportError:  # trees before devkit/ (e.g. e32f383)
    from extproc.devstack import Stack  # type: ignore[no-redef]

try:
    from bench.measure import RESULTS
except ImportError:
    from bench.run import RESULTS  # type: ignore[no-redef]

try:
    from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
except ImportError:
    ep_grpc = streams.ep_grpc

# Runs inside the processor: a thread that waits for `req-<k>` in CENSUS_DIR and answers
# with `census-<k>.pickle` (type tallies and the tracemalloc snapshot).
HOOK = r'''
import os, threading
if os.environ.get("CENSUS_DIR"):
    def _census_take(k):
        import gc, pickle, sys, tracemalloc
        d = os.environ["CENSUS_DIR"]
        if not tracemalloc.is_tracing():
            tracemalloc.start(12)  # not from startup: 12 frames make imports slow
        gc.collect()
        tracked = {}
        untracked = {}
        held_by = {}  # (holder's type, untracked referent's type) -> [count, bytes]
        seen = set()
        for o in gc.get_objects():
            t = type(o)
            name = f"{t.__module__}.{t.__qualname__}"
            c = tracked.setdefault(name, [0, 0])
            c[0] += 1
            c[1] += sys.getsizeof(o, 0)
            for r in gc.get_referents(o):
                if gc.is_tracked(r) or id(r) in seen:
                    continue
                seen.add(id(r))
                rt = type(r)
                rn = f"{rt.__module__}.{rt.__qualname__}"
                u = untracked.setdefault(rn, [0, 0])
                u[0] += 1
                u[1] += sys.getsizeof(r, 0)
                h = held_by.setdefault(f"{name} -> {rn}", [0, 0])
                h[0] += 1
                h[1] += sys.getsizeof(r, 0)
        seen.clear()
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)])
        out = os.path.join(d, f"census-{k}.pickle")
        with open(out + ".tmp", "wb") as f:
            pickle.dump({"tracked": tracked, "untracked": untracked, "held_by": held_by,
                         "snapshot": snap}, f)
        os.replace(out + ".tmp", out)

    def _census_watch():
        import time
        d = os.environ["CENSUS_DIR"]
        k = 0
        while True:
            if os.path.exists(os.path.join(d, f"req-{k}")):
                _census_take(k)  # its locals (the last snapshot) gone before the next
                k += 1
            else:
                time.sleep(0.2)

    threading.Thread(target=_census_watch, name="census", daemon=True).start()
'''


def census(d: Path, k: int, timeout: float = 300.0) -> dict[str, Any]:
    (d / f"req-{k}").write_text("")
    out = d / f"census-{k}.pickle"
    t0 = time.monotonic()
    while not out.exists():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"no census {k} from the processor")
        time.sleep(0.2)
    with open(out, "rb") as f:
        data: dict[str, Any] = pickle.load(f)
    return data


def _project_frame(tb: tracemalloc.Traceback) -> str:
    for fr in reversed(tb):  # tracemalloc orders oldest first
        if "/extproc/" in fr.filename and "/extproc/gen/" not in fr.filename:
            return f"{fr.filename.split('/extproc/', 1)[1]}:{fr.lineno}"
    return "(no extproc frame)"


def _innermost(tb: tracemalloc.Traceback) -> str:
    fr = tb[-1]
    name = fr.filename
    for cut in ("/site-packages/", "/extproc/", "/lib/python3"):
        if cut in name:
            name = name.split(cut, 1)[1]
            break
    return f"{name}:{fr.lineno}"


def _by(snap: tracemalloc.Snapshot, key: Any) -> Counter[str]:
    c: Counter[str] = Counter()
    for tr in snap.traces:
        c[key(tr.traceback)] += tr.size
    return c


def _diff(a: dict[str, list[int]], b: dict[str, list[int]], n: int
          ) -> list[tuple[str, float, float]]:
    rows = []
    for name in set(a) | set(b):
        ca, sa = a.get(name, [0, 0])
        cb, sb = b.get(name, [0, 0])
        if cb != ca or sb != sa:
            rows.append((name, (cb - ca) / n, (sb - sa) / n))
    return sorted(rows, key=lambda r: -abs(r[2]))


async def _hold(addr: str, n: int, d: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = ep_grpc.ExternalProcessorStub(ch)
        await streams.warm_up(stub, 2.0)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, census, d, 0)  # starts tracemalloc
        release = asyncio.Event()
        held: list[Any] = []
        tasks: list[Any] = []
        shots = []
        for target in (n, 2 * n):
            while len(held) < target:
                batch = [streams.Held(stub, release) for _ in range(min(250, target - len(held)))]
                held += batch
                tasks += [asyncio.ensure_future(h.run()) for h in batch]
                await asyncio.gather(*(h.opened.wait() for h in batch))
            await asyncio.sleep(1.0)
            ok = sum(1 for h in held if h.ok)
            if ok != target:
                raise RuntimeError(f"{ok}/{target} streams open")
            shots.append(await loop.run_in_executor(None, census, d, len(shots) + 1))
        release.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return shots[0], shots[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.census", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=2000, help="N: census at N and 2N open")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", type=Path, help="also write the per-stream rows here")
    a = ap.parse_args(argv)
    n = max(10, min(a.streams, 5000))
    with tempfile.TemporaryDirectory(prefix="census-") as tmp:
        d = Path(tmp)
        (d / "hook").mkdir()
        (d / "hook" / "sitecustomize.py").write_text(HOOK)
        path = os.pathsep.join([str(d / "hook"), *filter(None, [os.environ.get("PYTHONPATH")])])
        work = RESULTS / "work" / "census"
        stack = Stack(workdir=work, config={"timeouts": {"stall_after_first_delta_s": 600.0}},
                      replicas=1, processor_env={"CENSUS_DIR": str(d), "PYTHONPATH": path}).start()
        try:
            asyncio.set_event_loop(asyncio.new_event_loop())
            loop = asyncio.get_event_loop()
            first, second = loop.run_until_complete(_hold(stack.processor_addr, n, d))
            loop.close()
        finally:
            stack.stop()
    rows: dict[str, Any] = {}
    for part in ("tracked", "untracked", "held_by"):
        diff = _diff(first.get(part, {}), second.get(part, {}), n)
        rows[part] = diff
        total = sum(r[2] for r in diff)
        print(f"\n{part} objects per open stream (gc; sys.getsizeof): {total:,.0f} bytes")
        for name, cnt, size in diff[:a.top]:
            print(f"  {size:9.1f} B {cnt:7.2f}x  {name}")
    s1, s2 = first["snapshot"], second["snapshot"]
    if s1 is not None and s2 is not None:
        total = (sum(t.size for t in s2.traces) - sum(t.size for t in s1.traces)) / n
        print(f"\ntracemalloc per open stream: {total:,.0f} bytes")
        for label, key in (("innermost frame", _innermost), ("project frame", _project_frame)):
            b1, b2 = _by(s1, key), _by(s2, key)
            diff2 = sorted(((k, (b2[k] - b1[k]) / n) for k in set(b1) | set(b2)
                            if b2[k] != b1[k]), key=lambda r: -abs(r[1]))
            rows[label] = diff2
            print(f"\n  by {label}:")
            for k, v in diff2[:a.top]:
                print(f"  {v:9.1f} B  {k}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
