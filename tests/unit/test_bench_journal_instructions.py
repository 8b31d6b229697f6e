"""bench/journal_instructions.py's pure parts: counts by object, per request, the table."""

from __future__ import annotations

import pytest

from bench.journal_instructions import by_object, kind_of, object_of, per_request, table

# callgrind_annotate's per-function lines as 3.19 prints them (self counts).
ANNOTATE = """\
--------------------------------------------------------------------------------
Ir
--------------------------------------------------------------------------------
1,000,000 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                 file:function
--------------------------------------------------------------------------------
600,000 (60.00%)  /tmp/py/Python/ceval.c:_PyEval_EvalFrameDefault [/root/lib/libpython3.11.so.1.0]
 50,000 ( 5.00%)  ???:grpc_core::Foo() [/v/grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so]
 30,000 ( 3.00%)  ???:upb_Decode [/v/site-packages/google/_upb/_message.abi3.so]
 20,000 ( 2.00%)  ./string/memcpy.S:__memcpy_avx [/usr/lib/x86_64-linux-gnu/libc.so.6]
  7,000 ( 0.70%)  ???:EVP_x [/usr/lib/x86_64-linux-gnu/libcrypto.so.3]
    900 ( 0.09%)  ???:0x000000000001f0c0 [???]
"""


def test_objects_are_classed_by_their_file_name() -> None:
    assert object_of("/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0") == "libpython"
    assert object_of("/v/grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so") == "cygrpc"
    assert object_of("/v/google/_upb/_message.abi3.so") == "upb"
    assert object_of("/usr/lib/x86_64-linux-gnu/libc.so.6") == "libc"
    assert object_of("/usr/lib/x86_64-linux-gnu/libcrypto.so.3") == "other"
    assert object_of("???") == "other"


def test_annotate_lines_sum_by_object_and_the_totals_line_is_not_one() -> None:
    assert by_object(ANNOTATE) == {"libpython": 600_000, "cygrpc": 50_000, "upb": 30_000,
                                   "libc": 20_000, "other": 7_900}


def test_per_request_is_the_difference_over_the_difference_of_n() -> None:
    small = {"libpython": 1_000, "cygrpc": 500, "upb": 0, "libc": 10, "other": 5}
    large = {"libpython": 3_000, "cygrpc": 900, "upb": 100, "libc": 10, "other": 25}
    assert per_request(small, large, 50, 150) == {"libpython": 20.0, "cygrpc": 4.0,
                                                  "upb": 1.0, "libc": 0.0, "other": 0.2}
    with pytest.raises(ValueError, match="larger"):
        per_request(small, large, 150, 150)


def test_profiled_functions_are_ours_grpc_asyncio_or_other() -> None:
    assert kind_of("/w/extproc/adapters/etcd_client.py") == "ours"
    assert kind_of("/v/site-packages/grpc/aio/_call.py") == "grpc"
    assert kind_of("/py/lib/python3.11/asyncio/events.py") == "asyncio"
    assert kind_of("/v/site-packages/uvloop/__init__.py") == "asyncio"
    assert kind_of("/py/lib/python3.11/json/encoder.py") == "other"
    assert kind_of("~") == "other"


def test_the_table_has_a_column_per_store_and_a_total() -> None:
    t = table({"etcd": {"libpython": 1_100_000.0, "cygrpc": 360_000.0, "upb": 200_000.0,
                        "libc": 120_000.0, "other": 300_000.0},
               "memory": {"libpython": 300_000.0}})
    assert t.splitlines()[0] == "| per request | etcd | memory |"
    assert "| libpython | 1,100,000 | 300,000 |" in t
    assert "| upb | 200,000 | 0 |" in t
    assert "| total | 2,080,000 | 300,000 |" in t


def test_the_driver_plays_the_three_transactions_on_the_memory_store() -> None:
    """The driver imports the store as it is laid out today and plays whole requests: a
    renamed method fails here, not in a benchmark run weeks later."""
    from bench.journal_instructions import _run, play

    marks: list[str] = []
    began: list[bool] = []
    _run(play("memory", None, 3, 2, lambda: began.append(True), marks.append))
    assert began == [True] and marks == ["journal"]


def test_a_part_is_net_of_the_wrapper_once_per_call() -> None:
    from bench.journal_instructions import calls_in, net_of_wrapper

    assert calls_in("noise\njournal-instructions calls 300\nmore\n") == 300
    with pytest.raises(ValueError, match="calls"):
        calls_in("journal-instructions calls\n")
    assert net_of_wrapper(13_126.0, 3.0, 1_950.0) == 7_276.0
