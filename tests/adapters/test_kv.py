"""adapters/kv: the port's own vocabulary, the compares' meanings as etcd has them and the
range end of a prefix. (Both implementations are held to etcd's semantics by one suite,
tests/adapters/test_kv_memory.py, on the fake and on a real etcd.)"""

from __future__ import annotations

import pytest

from extproc.adapters.kv import (
    Cmp,
    Target,
    Txn,
    absent,
    mod_is,
    prefix_end,
    present,
    value_below,
    value_is,
    version_is,
)


@pytest.mark.parametrize(("prefix", "end"), [
    (b"/gw/live/", b"/gw/live0"),
    (b"a", b"b"),
    (b"a\xff", b"b"),
    (b"a\xff\xff", b"b"),
    (b"\xff", b"\0"),  # every key from the prefix on: etcd's "\0" range end
    (b"", b"\0"),
])
def test_prefix_end_is_the_first_key_after_the_prefix(prefix: bytes, end: bytes) -> None:
    assert prefix_end(prefix) == end
    if prefix and end != b"\0":
        for inside in (prefix, prefix + b"\0", prefix + b"\xff\xff"):
            assert prefix <= inside < end


def test_compares_say_what_etcd_compares() -> None:
    k = b"/k"
    assert (value_is(k, b"v").target, value_is(k, b"v").result) == (Target.VALUE, Cmp.EQUAL)
    assert (value_below(k, b"v").target, value_below(k, b"v").result) == (Target.VALUE,
                                                                          Cmp.LESS)
    # An absent key has version 0: "absent" and "present" are version compares.
    assert absent(k) == version_is(k, 0)
    assert (present(k).target, present(k).result, present(k).value) == (Target.VERSION,
                                                                        Cmp.GREATER, 0)
    assert (mod_is(k, 9).target, mod_is(k, 9).value) == (Target.MOD, 9)


def test_a_transaction_is_a_value_with_empty_branches_by_default() -> None:
    t = Txn()
    assert (tuple(t.compare), tuple(t.success), tuple(t.failure)) == ((), (), ())
    assert Txn([absent(b"a")]) == Txn([absent(b"a")])
