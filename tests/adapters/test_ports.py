"""adapters/ports: the Protocols the sessions declare, and the only two places the system's
clock and randomness are read (SystemClock, RandomIds): ids in the shapes the journal and
the credential check accept, fresh each time."""

from __future__ import annotations

import time

from extproc.adapters.ports import Clock, Ids, RandomIds, SystemClock, credential
from extproc.core.credentials import digest, matches, well_formed
from extproc.core.journal import REQUEST_ID_RE

from .support import FakeClock, FixedIds


def test_the_system_clock_is_monotonic_and_its_wall_is_now_to_the_microsecond() -> None:
    c = SystemClock()
    a, b = c.monotonic(), c.monotonic()
    assert b >= a
    before, w, after = time.time(), c.wall(), time.time()
    assert before - 1e-6 <= w <= after + 1e-6
    assert round(w, 6) == w
    # As records and logs write it: never more than six decimals.
    walls = [c.wall() for _ in range(2000)]
    assert all(len(repr(x).partition(".")[2]) <= 6 for x in walls)


def test_random_ids_have_the_journal_s_shapes_and_do_not_repeat() -> None:
    ids = RandomIds()
    rids = [ids.request_id() for _ in range(200)]
    assert all(REQUEST_ID_RE.match(r) for r in rids) and len(set(rids)) == 200
    aid = ids.attempt_id()
    assert aid.startswith("att_") and REQUEST_ID_RE.match("req_" + aid[4:])
    assert ids.attempt_id() != aid
    inst = ids.instance_id()
    assert inst.startswith("proc_") and len(inst) == 5 + 16 and ids.instance_id() != inst


def test_request_ids_are_ordered_by_time() -> None:
    """ULID layout: a later millisecond sorts later (the journal lists by key)."""
    ids = RandomIds()
    first = ids.request_id()
    t0 = time.time()
    while time.time() - t0 < 0.003:  # a bounded spin past the next millisecond, no sleep
        pass
    assert ids.request_id()[:14] > first[:14]


def test_a_credential_is_a_fresh_secret_and_the_digest_the_journal_keeps() -> None:
    ids = RandomIds()
    secret, kept = credential(ids)
    assert well_formed(secret) and kept == digest(secret) and secret not in kept
    assert matches(secret, kept)
    assert credential(ids)[0] != secret


def test_the_test_doubles_satisfy_the_same_ports() -> None:
    """The hermetic harness injects these in place of the system's: same Protocols."""
    clocks: list[Clock] = [SystemClock(), FakeClock()]
    idss: list[Ids] = [RandomIds(), FixedIds()]
    assert all(isinstance(c.wall(), float) for c in clocks)
    assert all(REQUEST_ID_RE.match(i.request_id()) for i in idss)
    assert all(well_formed(i.attempt_secret()) for i in idss)
