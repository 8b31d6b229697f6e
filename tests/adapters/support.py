"""Constants and small fakes shared by the hermetic adapter tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from extproc.adapters.kv import KV, Lease, Txn, TxnResult, WatchEvent
from extproc.adapters.timers import FakeClock, FakeTimers

__all__ = ["RID", "SSE_CONTENT", "SSE_DONE", "SSE_ROLE", "FakeClock", "FakeTimers",
           "FixedIds", "KVTap", "idle", "run_on"]

RID = "req_0123456789abcdefghjkmnpqrs"
SSE_ROLE = (b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
            b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n')
SSE_CONTENT = (b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
               b'"delta":{"content":"tok"},"finish_reason":null}]}\n\n')
SSE_DONE = b"data: [DONE]\n\n"
# A token event in vLLM's own form (the guard's fast path takes a message of such events;
# core.guard.streaming_chunk), and with the running usage the gateway asks for.
SSE_VLLM = (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"content":"tok"},"logprobs":null,'
            b'"finish_reason":null}]}\n\n')


def sse_vllm_usage(n: int) -> bytes:
    return SSE_VLLM[:-3] + (b',"usage":{"prompt_tokens":4,"total_tokens":%d,'
                            b'"completion_tokens":%d}}\n\n' % (4 + n, n))


class FixedIds:
    """Deterministic ids: att_test_1, att_test_2, ...; request ids req_000...1, ..."""

    def __init__(self) -> None:
        self.n = 0
        self.secrets = 0  # counted apart, so the ids stay what they were
        self.requests = 0

    def request_id(self) -> str:
        """Shaped as the gateway mints them (ULID layout), counted apart from attempt ids."""
        self.requests += 1
        return f"req_{self.requests:026d}"

    def attempt_id(self) -> str:
        self.n += 1
        return f"att_test_{self.n}"

    def attempt_secret(self) -> str:
        """Shaped as the gateway mints them (43 url-safe characters): secret_test_1_xxx..."""
        self.secrets += 1
        return f"secret_test_{self.secrets}_".ljust(43, "x")

    def instance_id(self) -> str:
        return "proc_test"



async def idle(turns: int = 50) -> None:
    """Let every task that can run, run (no time passes): what a test checks after this did
    not happen for want of a turn of the loop."""
    for _ in range(turns):
        await asyncio.sleep(0)


T = TypeVar("T")


async def run_on(timers: FakeTimers, aw: Awaitable[T], turns: int = 20,
                 limit_s: float = 3600.0) -> T:
    """Run `aw` to its end on the fake clock: whenever every task that can run has run,
    move the clock to the next timer's deadline (time passes only when nothing else can
    happen, as on an idle loop). A wait no timer ends fails the test at once."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            await idle(turns)
            if task.done():
                return task.result()
            due = timers.next_due()
            if due is None or due > limit_s:
                raise AssertionError(f"stuck at {timers.clock.now} s: no timer ends the wait")
            timers.advance(due - timers.clock.now)
    finally:
        task.cancel()


class KVTap:
    """A `KV` whose watches and transactions a test can see and wait for, instead of
    sleeping while a real etcd creates a watch's stream or delivers its events.

    Per watched prefix: whether its stream is up (kv_etcd says so when etcd answers
    `created`; kv_memory at once) and every event it delivered, in its stream's order (one
    etcd stream delivers in revision order: once a later event came, an earlier one did).
    Every transaction's answer is kept too. `until(pred)` waits, bounded, for what the tap
    saw to satisfy `pred`, woken by each thing it sees: no polling, no sleep."""

    def __init__(self, inner: KV) -> None:
        self.inner = inner
        self.up: dict[bytes, bool] = {}
        self.events: dict[bytes, list[WatchEvent]] = {}
        self.txns: list[tuple[Txn, TxnResult]] = []
        self._moved = asyncio.Event()

    def _saw(self) -> None:
        self._moved.set()

    async def until(self, pred: Callable[[], bool], what: str, s: float = 5.0) -> None:
        async def wait() -> None:
            while not pred():
                self._moved.clear()
                await self._moved.wait()
        try:
            await asyncio.wait_for(wait(), s)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}") from None

    def delivered(self, prefix: bytes, key: bytes, value: bytes | None) -> bool:
        """The watch of `prefix` delivered that change of `key`."""
        return any(e.key == key and e.value == value for e in self.events.get(prefix, ()))

    # --- the port, passed through ---------------------------------------------------------

    async def txn(self, t: Txn) -> TxnResult:
        res = await self.inner.txn(t)
        self.txns.append((t, res))
        self._saw()
        return res

    async def grant(self, ttl_s: float) -> Lease:
        return await self.inner.grant(ttl_s)

    async def keep_alive(self, lease_id: int, deadline_s: float | None = None) -> int:
        return await self.inner.keep_alive(lease_id, deadline_s)

    async def time_to_live(self, lease_id: int) -> int:
        return await self.inner.time_to_live(lease_id)

    async def revoke(self, lease_id: int) -> None:
        await self.inner.revoke(lease_id)

    def watch(self, prefix: bytes, on_event: Callable[[WatchEvent], None],
              on_state: Callable[[bool], None] | None = None,
              name: str = "watch") -> Callable[[], None]:
        seen = self.events.setdefault(prefix, [])

        def event(ev: WatchEvent) -> None:
            seen.append(ev)
            on_event(ev)
            self._saw()

        def state(up: bool) -> None:
            self.up[prefix] = up
            if on_state is not None:
                on_state(up)
            self._saw()
        return self.inner.watch(prefix, event, state, name)

    async def close(self) -> None:
        await self.inner.close()
