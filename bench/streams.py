"""Open streams held by one processor process, and the memory each costs.

    .venv/bin/python -m bench.streams                 # 10,000 streams (checkpoint at 2,500, 5,000)
    .venv/bin/python -m bench.streams --streams 2000

Envoy on this machine cannot carry 10,000 HTTP/1.1 streams (each is a downstream and an
upstream socket; the hard file limit here is 20,000), so this figure drives the processor
directly with the messages Envoy's downstream ext_proc filter sends for a streaming request:
request headers, request body (the intake: validation, the journal record and attempt 1's
admission in the real etcd), response headers, then a role event and two content events, so
every stream is past its first delta with its stall watchdog armed, as a real open stream is.
The streams stay open while the processor's resident memory (VmRSS) is read; per-stream cost =
(RSS with N open - RSS before) / N, at several N to show it is linear. Then 1,000 of them go
on for 200 more token messages each (what a stream a few hundred tokens in holds: its event
trace grows up to `telemetry.max_trace_bytes`, its delivery marks by 8 bytes per content
event here, 16 with running usage, decisions 0025, 0053), and the RSS growth per long
stream is read too. That growth is the whole process's over the phase divided by the
streams that went on, so anything the other open streams add meanwhile counts in it; the
phase's length and the streams held are printed with it (docs/benchmarks.md, "Memory per
long stream": before decision 0053 every open stream took a CHECKPOINT tick's record into
its trace every `timeouts.progress_interval_s`; now an idle stream is woken once after its
last write and not again). The processor runs its
default configuration except `stall_after_first_delta_s` (raised so that the watchdog does
not end streams that the driver keeps silent while it opens the rest).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.measure import RESULTS, run_loop
from devkit.devstack import Stack
from extproc.gen.envoy.config.core.v3 import base_pb2 as core
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

BODY = json.dumps({"model": "demo-model", "stream": True, "max_tokens": 64,
                   "messages": [{"role": "user", "content": "hold me open"}]}).encode()


def _headers(pairs: dict[str, str], eos: bool = False) -> ep.HttpHeaders:
    return ep.HttpHeaders(headers=core.HeaderMap(headers=[
        core.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
        end_of_stream=eos)


def _event(delta: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk",
                                   "choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n"


MESSAGES = [
    ep.ProcessingRequest(request_headers=_headers({
        ":method": "POST", ":path": "/v1/chat/completions", ":authority": "bench",
        ":scheme": "http", "content-type": "application/json"})),
    ep.ProcessingRequest(request_body=ep.HttpBody(body=BODY, end_of_stream=True)),
    ep.ProcessingRequest(response_headers=_headers({":status": "200",
                                                    "content-type": "text/event-stream"})),
    ep.ProcessingRequest(response_body=ep.HttpBody(
        body=_event({"role": "assistant", "content": ""}) + _event({"content": "Hello"}),
        end_of_stream=False)),
    ep.ProcessingRequest(response_body=ep.HttpBody(body=_event({"content": " world"}),
                                                   end_of_stream=False)),
]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


TOKEN = ep.ProcessingRequest(response_body=ep.HttpBody(body=_event({"content": " more"}),
                                                        end_of_stream=False))
LONG_STREAMS, LONG_TOKENS = 1000, 200


class Held:
    """One guard stream, opened and then kept open until `release` is set."""

    def __init__(self, stub: Any, release: asyncio.Event) -> None:
        self.stub, self.release = stub, release
        self.ok = False
        self.opened = asyncio.Event()
        self.call: Any = None

    async def more(self, k: int) -> bool:
        """k more token messages on the open stream (while `run` waits for release)."""
        try:
            for _ in range(k):
                await self.call.write(TOKEN)
                await self.call.read()
        except grpc.aio.AioRpcError:
            return False
        return True

    async def run(self) -> None:
        call = self.call = self.stub.Process(metadata=(("x-extproc-role", "guard"),))
        try:
            for msg in MESSAGES:
                await call.write(msg)
                await call.read()
            self.ok = True
        except grpc.aio.AioRpcError:
            pass
        finally:
            self.opened.set()
        await self.release.wait()
        call.cancel()


async def warm_up(stub: Any, settle_s: float, tolerate_errors: bool = False) -> None:
    """A few hundred complete streams first, so first-use allocations are not counted;
    then `settle_s` for what they leave behind (journal records) to finish."""
    release = asyncio.Event()
    warm = [Held(stub, release) for _ in range(200)]
    tasks = [asyncio.ensure_future(h.run()) for h in warm]
    await asyncio.gather(*(h.opened.wait() for h in warm))
    release.set()
    await asyncio.gather(*tasks, return_exceptions=tolerate_errors)
    await asyncio.sleep(settle_s)


async def hold(stack: Stack, n: int, checkpoints: list[int], log: Any) -> dict[str, Any]:
    pid = stack.procs["processor"].pid
    assert pid is not None
    async with grpc.aio.insecure_channel(stack.processor_addr) as ch:
        stub = ep_grpc.ExternalProcessorStub(ch)
        await warm_up(stub, 2.0)
        base = rss_kib(pid)
        release = asyncio.Event()
        held: list[Held] = []
        points: list[dict[str, Any]] = []
        t0 = time.monotonic()
        tasks = []
        for target in checkpoints:
            while len(held) < target:
                batch = [Held(stub, release) for _ in range(min(250, target - len(held)))]
                held += batch
                tasks += [asyncio.ensure_future(h.run()) for h in batch]
                await asyncio.gather(*(h.opened.wait() for h in batch))
            await asyncio.sleep(1.0)
            rss = rss_kib(pid)
            ok = sum(1 for h in held if h.ok)
            points.append({"streams": target, "open_ok": ok, "rss_kib": rss,
                           "kib_per_stream": (rss - base) / max(1, ok)})
            log(f"  {ok}/{target} streams open, processor RSS {rss / 1024:.1f} MiB, "
                f"{(rss - base) / max(1, ok):.2f} KiB/stream ({time.monotonic() - t0:.0f} s)")
        long = [h for h in held if h.ok][:LONG_STREAMS]
        before = rss_kib(pid)
        t_long = time.monotonic()
        went_on = 0
        for i in range(0, len(long), 100):  # 100 at a time: bounded concurrency
            went_on += sum(await asyncio.gather(*(h.more(LONG_TOKENS)
                                                  for h in long[i:i + 100])))
        seconds = time.monotonic() - t_long
        await asyncio.sleep(1.0)
        after = rss_kib(pid)
        longer = {"streams": len(long), "went_on": went_on, "tokens_each": LONG_TOKENS,
                  "rss_before_kib": before, "rss_after_kib": after,
                  "extra_kib_per_stream": (after - before) / max(1, went_on),
                  "seconds": round(seconds, 1), "others_open": sum(1 for h in held if h.ok)
                  - went_on}
        log(f"  {went_on} streams went on for {LONG_TOKENS} more tokens: "
            f"+{longer['extra_kib_per_stream']:.2f} KiB/stream ({seconds:.0f} s, "
            f"{longer['others_open']} other streams open meanwhile)")
        release.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"baseline_rss_kib": base, "points": points, "long": longer}


def measure(n: int, work: Path, log: Any) -> dict[str, Any]:
    checkpoints = sorted({max(1, n // 4), max(1, n // 2), n})
    stack = Stack(workdir=work, config={"timeouts": {"stall_after_first_delta_s": 600.0}},
                  replicas=1).start()
    try:
        out: dict[str, Any] = run_loop(hold(stack, n, checkpoints, log))
        out["processor_alive"] = stack.procs["processor"].alive()
    finally:
        stack.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.streams", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=10_000)
    a = ap.parse_args(argv)
    n = max(10, min(a.streams, 10_000))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    r = measure(n, RESULTS / "work" / "streams", log)
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
