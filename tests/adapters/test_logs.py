"""Request log lines: the direct write and the logging path give the same JSON object."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from extproc.adapters import logs


@pytest.fixture()
def captured(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    buf = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logs._direct)
    monkeypatch.setattr(sys, "stderr", buf)
    logs.setup("INFO")
    yield buf
    root.handlers[:], _, logs._direct = saved
    root.setLevel(saved[1])


def _line(log: logging.Logger) -> None:
    logs.rlog(log, logging.INFO, "attempt ended", "req_1", "att_1", attempt=1, released=True,
              cause=None, odd={1, 2})  # a value JSON cannot encode: written with str()


def test_direct_and_logging_paths_write_the_same_object(captured: io.StringIO) -> None:
    log = logging.getLogger("extproc.test")
    root = logging.getLogger()
    pytest_handlers = [h for h in root.handlers if h is not logs._direct]
    for h in pytest_handlers:  # pytest's own capture handlers, added for the test's call
        root.removeHandler(h)
    _line(log)
    assert logs._direct_handler(log) is not None  # the direct path was taken
    direct = json.loads(captured.getvalue())
    captured.seek(0)
    captured.truncate()
    other = logging.StreamHandler(io.StringIO())
    logging.getLogger().addHandler(other)  # someone else listens: the ordinary path
    assert logs._direct_handler(log) is None
    _line(log)
    ordinary = json.loads(captured.getvalue())
    logging.getLogger().removeHandler(other)
    for h in pytest_handlers:
        root.addHandler(h)
    for d in (direct, ordinary):
        assert isinstance(d.pop("ts"), float)
    assert list(direct.items()) == list(ordinary.items())
    assert direct == {"level": "INFO", "logger": "extproc.test", "msg": "attempt ended",
                      "request_id": "req_1", "attempt_id": "att_1", "attempt": 1,
                      "released": True, "cause": None, "odd": "{1, 2}"}


def test_below_the_level_nothing_is_written(captured: io.StringIO) -> None:
    log = logging.getLogger("extproc.test")
    logs.rlog(log, logging.DEBUG, "chatty", "req_1", None)
    assert captured.getvalue() == ""


def test_the_line_encoder_writes_what_the_formatters_encoder_writes() -> None:
    """The direct path's C encoder, built once, against JSONEncoder's own (same settings)."""
    obj = {"ts": 1764711234.123456, "msg": "é \u2028 \" \\ \n", "nan": float("nan"),
           "inf": float("-inf"), "nested": [1, 2.5, {"a": (1, None)}], "set": {3},
           "keys": {1: "a", None: "b", 2.5: "c", False: "d"}, "bytes": b"x", "big": 10**30}
    assert logs._LINE_ENCODER is not None  # CPython's C part: the path taken in production
    assert "".join(logs._LINE_ENCODER(obj, 0)) == logs._ENCODER.encode(obj)


def test_a_stamp_is_the_repr_of_its_microseconds_as_a_float() -> None:
    """The direct path's `ts`, written from integers: the text `repr(us / 1e6)` gives, for
    every kind of fraction (none, trailing zeros, all six digits) over this century."""
    import random

    rng = random.Random(7)
    cases = [0, 100_000, 999_999_000, 1_796_281_779_271_494_000, 1_796_281_779_000_000_999,
             1_796_281_779_200_000_000, 1_796_281_779_000_001_000, 4_294_967_295_999_999_999,
             4_294_967_296_000_001_000, 10**19 + 123_456_789]
    cases += [rng.randrange(946_684_800, 4_102_444_800) * 10**9 + rng.randrange(10**9)
              for _ in range(20_000)]
    cases += [rng.randrange(946_684_800, 4_102_444_800) * 10**9 + rng.randrange(10) * 10**8
              for _ in range(2_000)]
    cases += [rng.randrange(1 << 32, 1 << 34) * 10**9 + rng.randrange(10**9)
              for _ in range(2_000)]
    for ns in cases:
        assert logs.stamp(ns) == repr(ns // 1000 / 1e6), ns


def test_a_line_s_stamp_is_the_clock_s_to_the_microsecond(
        captured: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    monkeypatch.setattr(time, "time_ns", lambda: 1_796_281_779_271_494_999)
    log = logging.getLogger("extproc.test")
    # pytest's own capture handlers, added for the test's call, out of the way: the direct
    # path is the one written.
    monkeypatch.setattr(logging.getLogger(), "handlers", [logs._direct])
    assert logs._direct_handler(log) is not None
    logs.rlog(log, logging.INFO, "first delta", "req_1", None, ms=1.5)
    assert captured.getvalue() == ('{"ts":1796281779.271494,"level":"INFO","logger":'
                                   '"extproc.test","msg":"first delta","request_id":"req_1",'
                                   '"attempt_id":null,"ms":1.5}\n')
