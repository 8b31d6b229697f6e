"""Every message-path floor (bench/floors.py) is a correct null processor: a stream through
its stack (the same rendered Envoy config, guard and gate filters, a demo replica) gets the
exact bytes plain Envoy gives for the same request, and so does a request Envoy buffers.

The replica's response id is the only per-request value (it embeds Envoy's x-request-id): it
is replaced by the same placeholder on both sides before the byte comparison.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.floors import FLOORS
from devkit.devstack import Stack

pytestmark = pytest.mark.e2e

# 256 tokens with no delay: Envoy hands the guard several body messages back to back, so
# grpclib-coalesce does coalesce here (a coalescing answer that drops a part fails this
# test; grpc.aio's reads are too slow for body messages to wait in this one); 4 at once, so
# streams interleave on the ext_proc connection.
BODIES = [{"model": "demo-model", "stream": True, "max_tokens": 256, "seed": s,
           "messages": [{"role": "user", "content": f"floor {s}"}]} for s in (1, 2, 3, 4)]
UNARY = {"model": "demo-model", "stream": False, "max_tokens": 16, "seed": 9,
         "messages": [{"role": "user", "content": "floor"}]}
_ID = re.compile(rb'"id": ?"(chatcmpl-[^"]+)"')


def _fetch(base_url: str, body: dict[str, object]) -> tuple[int, bytes]:
    with httpx.Client(base_url=base_url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json=body)
        raw = r.content
    m = _ID.search(raw)
    assert m, raw[:200]
    return r.status_code, raw.replace(m.group(1), b"ID")


def _all(stack: Stack) -> list[tuple[int, bytes]]:
    stack.wait_replicas_healthy(15.0)
    with ThreadPoolExecutor(4) as ex:
        out = list(ex.map(lambda b: _fetch(stack.base_url, b), BODIES))
    return [*out, _fetch(stack.base_url, UNARY)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[int, bytes]]]:
    st = Stack(workdir=tmp_path_factory.mktemp("plain"), replicas=1, plain=True).start()
    try:
        yield _all(st)
    finally:
        st.stop()


@pytest.mark.parametrize("name", list(FLOORS))
def test_floor_gives_plain_envoys_bytes(name: str, plain: list[tuple[int, bytes]],
                                        tmp_path: Path) -> None:
    f = FLOORS[name]
    st = f.stack_class("demo")(workdir=tmp_path, replicas=1,
                               processor_env=dict(f.env) or None).start()
    try:
        got = _all(st)
        assert st.procs["processor"].alive()
    finally:
        st.stop()
    for (status, raw), (ref_status, ref) in zip(got, plain, strict=True):
        assert status == ref_status == 200
        assert raw.endswith(b"data: [DONE]\n\n") or raw.startswith(b"{")
        assert raw == ref
