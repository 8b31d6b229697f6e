"""Cells (decision 0019): two Envoy + processor pairs on one port, one etcd, one pool.

The kernel spreads new connections over the two Envoys (SO_REUSEPORT); a request lives in
the cell its connection landed on. Per request, the same contract as with one cell; across
cells, the contract of several gateways on one etcd. Each request below opens its own
connection, and the journal's attempts name the cell (`gateway_id`) that ran them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.devstack import Stack

from .conftest import E2E_CONFIG, Gateway, Result

pytestmark = pytest.mark.e2e

MAX = 8
CELLS = ("gw-1", "gw-1-c2")
TRIES = 24  # new connections tried to land on a given cell: 2 x 0.5^24 to miss it


@pytest.fixture(scope="module")
def cells(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    wd: Path = tmp_path_factory.mktemp("cells")
    st = Stack(workdir=wd, config=E2E_CONFIG, replicas=2, cells=2).start()
    try:
        st.wait_replicas_healthy()
        yield st
    finally:
        st.stop()


def once(st: Stack, body: dict[str, object], **kw: object) -> Result:
    """One request on a connection of its own (a new client: a new source port)."""
    g = Gateway(st)
    try:
        return g.post(body, **kw)  # type: ignore[arg-type]
    finally:
        g.client.close()


def cell_of(st: Stack, rid: str) -> str:
    g = Gateway(st)
    try:
        j = g.journal(rid)
    finally:
        g.client.close()
    # A first attempt that no gate ever saw (connection refused) is recorded without one.
    ids = {a.get("gateway_id") for a in j["attempts"]} - {None}
    assert len(ids) == 1, j["attempts"]  # every attempt of a request in one cell
    return str(ids.pop())


def client_on(st: Stack, cell: str) -> Gateway:
    """A client whose (kept-alive) connection landed on `cell`, found with harmless
    requests: a fault request tried on connection after connection would kill a replica
    each time."""
    for _ in range(TRIES):
        g = Gateway(st)
        res = g.post(g.body(max_tokens=2))
        if res.status == 200 and cell_of(st, res.request_id) == cell:
            return g
        g.client.close()
    pytest.fail(f"no connection landed on {cell} in {TRIES} tries")


def test_both_cells_serve_one_port_and_answer_the_same(cells: Stack) -> None:
    gw = Gateway(cells)
    ref = gw.post(gw.body(max_tokens=MAX))
    gw.client.close()
    seen: dict[str, int] = {}
    for _ in range(16):
        res = once(cells, Gateway(cells).body(max_tokens=MAX))
        assert res.status == 200 and res.normalized() == ref.normalized()
        c = cell_of(cells, res.request_id)
        seen[c] = seen.get(c, 0) + 1
    assert set(seen) <= set(CELLS)
    assert set(seen) == set(CELLS), seen  # 2 x 0.5^16 to see one cell only by chance
    # Each cell's processor logged the requests it ran, and only those.
    for name, cell in (("processor", "gw-1"), ("processor-c2", "gw-1-c2")):
        text = cells.procs[name].log_path.read_text()
        assert text.count('"msg":"request accepted"') >= seen[cell]


@pytest.mark.parametrize("cell", CELLS)
def test_each_cell_reruns_before_and_never_after_the_first_delta(
        cells: Stack, cell: str) -> None:
    cells.wait_replicas_healthy(timeout_s=20)
    body = Gateway(cells).body(max_tokens=MAX)
    ref = once(cells, body)
    g = client_on(cells, cell)
    res = g.post(body, headers={"x-replica-fault": "kill-before-headers"})
    assert res.status == 200 and res.normalized() == ref.normalized()
    assert cell_of(cells, res.request_id) == cell  # the same connection, the same cell
    j = g.journal(res.request_id)
    assert (j["outcome"], len(j["attempts"])) == ("completed", 2)
    rows = g.attempts_logged(res.request_id)
    assert [(r["attempt"], r["outcome"]) for r in rows] == [(1, "killed"), (2, "completed")]
    g.client.close()
    cells.wait_replicas_healthy(timeout_s=20)
    g = client_on(cells, cell)
    cut = g.post(body, headers={"x-replica-fault": "kill-after-deltas:2"})
    assert cut.transport_error is not None and cut.contents == ref.contents[:2]
    assert cell_of(cells, cut.request_id) == cell
    j = g.journal(cut.request_id)
    assert (j["outcome"], j["delivered_output_tokens"], len(j["attempts"])) == (
        "upstream_decode_interrupted", 2, 1)
    assert [r["attempt"] for r in g.attempts_logged(cut.request_id)] == [1]
    g.client.close()
    cells.wait_replicas_healthy(timeout_s=20)


def test_a_repeat_on_the_other_cell_gets_the_recorded_outcome(cells: Stack) -> None:
    cells.wait_replicas_healthy(timeout_s=20)
    body = Gateway(cells).body(max_tokens=MAX)
    key = f"cells-{time.time_ns()}"
    first = once(cells, body, key=key, headers={"x-replica-fault": "kill-after-deltas:3"})
    assert first.transport_error is not None and len(first.contents) == 3
    home = cell_of(cells, first.request_id)
    other = "processor-c2" if home == "gw-1" else "processor"
    log = cells.procs[other].log_path
    # Repeat on new connections until the other cell answered one (its log says so).
    for _ in range(TRIES):
        again = once(cells, body, key=key)
        assert again.status == 409 and again.error is not None
        assert (again.error["code"], again.error["request_id"],
                again.error["delivered_output_tokens"]) == (
            "upstream_decode_interrupted", first.request_id, 3)
        if any('"msg":"repeat of a known request"' in line and first.request_id in line
               for line in log.read_text().splitlines()):
            break
    else:
        pytest.fail(f"no repeat landed on {other} in {TRIES} connections")
    g = Gateway(cells)
    assert [r["attempt"] for r in g.attempts_logged(first.request_id)] == [1]  # none re-ran
    g.client.close()
    cells.wait_replicas_healthy(timeout_s=20)
