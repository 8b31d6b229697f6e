"""Structured JSON logs: one object per line, request lines carry request_id and attempt_id."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_STD = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


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
        return json.dumps(out, default=str, separators=(",", ":"))


def setup(level: str = "INFO") -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(level)
    logging.Formatter.converter = time.gmtime


def rlog(logger: logging.Logger, level: int, msg: str, request_id: str | None,
         attempt_id: str | None, **fields: Any) -> None:
    """Log a line about a request; both ids are always present (null when not yet known)."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={"request_id": request_id, "attempt_id": attempt_id,
                                      **fields})
