"""The demo processes' JSON-lines logs, read while they are being written."""

from __future__ import annotations

from pathlib import Path

from devkit.devstack import _jsonl


def test_a_line_still_being_written_is_left_for_the_next_read(tmp_path: Path) -> None:
    log = tmp_path / "replica-r1.jsonl"
    assert _jsonl(log) == []  # not written yet
    log.write_text('{"attempt": 1}\n\n{"attempt": 2}\n{"ts": 1.0, "replica"')
    assert _jsonl(log) == [{"attempt": 1}, {"attempt": 2}]
    with log.open("a") as f:
        f.write(': "r1"}\n')
    assert _jsonl(log) == [{"attempt": 1}, {"attempt": 2}, {"ts": 1.0, "replica": "r1"}]
