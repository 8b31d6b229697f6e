"""docs/architecture.md draws the request's life exactly as the transition table has it."""

from __future__ import annotations

import re
from pathlib import Path

from extproc.core.machine import arrows

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_the_drawing_is_the_table() -> None:
    text = DOC.read_text()
    section = text.split("## A request's life, as the table draws it", 1)[1]
    blocks = re.findall(r"```\n(.*?)\n```", section, flags=re.S)[:2]
    assert blocks == ["\n".join(arrows("guard")), "\n".join(arrows("gate"))]
