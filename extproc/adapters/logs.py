"""Structured JSON logs: one object per line, request lines carry request_id and attempt_id."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_STD = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}
_ENCODER = json.JSONEncoder(default=str, separators=(",", ":"))
# The C encoder `_ENCODER.encode` builds for every line, built once (the same settings,
# and no circular check: a line's fields are flat values); None where the C part is absent.
_c_make = json.encoder.c_make_encoder  # type: ignore[attr-defined]
_LINE_ENCODER = (None if _c_make is None else
                 _c_make(None, str, json.encoder.encode_basestring_ascii, None, ":", ",",
                         False, False, True))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return _ENCODER.encode(out)


# The handler `setup` installed, while it is the root logger's only one: request lines then
# skip the logging machinery (a LogRecord, handler and formatter calls: about two thirds of a
# line's cost, and a processor writes five lines per request) and write the same JSON object
# the formatter would. Anyone who adds a handler or filter gets the ordinary path.
_direct: logging.StreamHandler[Any] | None = None


def setup(level: str = "INFO") -> None:
    global _direct
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(level)
    logging.Formatter.converter = time.gmtime
    _direct = h


def _direct_handler(logger: logging.Logger) -> logging.StreamHandler[Any] | None:
    h = _direct
    if h is None or logger.filters or logger.handlers or not logger.propagate:
        return None
    root = logging.getLogger()
    if root.handlers != [h] or root.filters or h.filters:
        return None
    return h


def stamp(ns: int) -> str:
    """Nanoseconds since the epoch -> the JSON number of its whole microseconds in seconds,
    the text `repr(us / 1e6)` gives, without the float: from 1 s to 2**32 s (the year
    2106) floats are closer than a microsecond, so the nearest float to a number of at most
    six decimals has those decimals as its shortest repr (no trailing zeros, at least
    one). Outside that range, that repr."""
    us = ns // 1000
    if not 1_000_000 <= us < _STAMP_END_US:
        return repr(us / 1e6)
    digits = str(us)  # one conversion; the seconds are all but its last six digits
    return digits[:-6] + "." + (digits[-6:].rstrip("0") or "0")


_STAMP_END_US = (1 << 32) * 1_000_000


def rlog(logger: logging.Logger, level: int, msg: str, request_id: str | None,
         attempt_id: str | None, **fields: Any) -> None:
    """Log a line about a request; both ids are always present (null when not yet known)."""
    if not logger.isEnabledFor(level):
        return
    h = _direct_handler(logger)
    if h is None:
        logger.log(level, msg, extra={"request_id": request_id, "attempt_id": attempt_id,
                                      **fields})
        return
    if _LINE_ENCODER is None or "ts" in fields:
        obj = {"ts": round(time.time(), 6), "level": logging.getLevelName(level),
               "logger": logger.name, "msg": msg, "request_id": request_id,
               "attempt_id": attempt_id, **fields}
        line = _ENCODER.encode(obj)
    else:
        # The same object, its first member written from the clock's integer microseconds
        # (`stamp`), not a float rounded (`round(t, 6)` and the float's repr: ~15k of a
        # line's ~52k instructions, both through the decimal conversion).
        rest = "".join(_LINE_ENCODER({
            "level": logging.getLevelName(level), "logger": logger.name, "msg": msg,
            "request_id": request_id, "attempt_id": attempt_id, **fields}, 0))
        line = '{"ts":' + stamp(time.time_ns()) + "," + rest[1:]
    with h.lock:  # type: ignore[union-attr]  # set by Handler.createLock
        stream = h.stream
        stream.write(line + "\n")
        stream.flush()  # what h.flush() does, under the lock already held
