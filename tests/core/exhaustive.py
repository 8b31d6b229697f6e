"""Every run of a small game, exhaustively: the property tests' one enumerator.

A run makes its choices through `choose(n)`; a run that needs a choice it was not given
raises `NeedChoice`, and `every` plays the prefix again once per option (depth first), so
each complete sequence of choices is played exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")


class NeedChoice(Exception):
    def __init__(self, n: int) -> None:
        self.n = n


class Chooser:
    """Mixin for a run: `choices` given so far, `at` the next one to use."""

    choices: list[int]
    at: int

    def choose(self, n: int) -> int:
        if self.at == len(self.choices):
            raise NeedChoice(n)
        c = self.choices[self.at]
        self.at += 1
        return c


def every(make: Callable[[list[int]], R], play: Callable[[R], Any]) -> list[R]:
    """Each complete run of `play`, on a run `make(choices)` builds for every choice prefix."""
    runs: list[R] = []
    stack: list[list[int]] = [[]]
    while stack:
        prefix = stack.pop()
        r = make(list(prefix))
        try:
            play(r)
        except NeedChoice as need:
            stack += [[*prefix, i] for i in range(need.n)]
            continue
        runs.append(r)
    return runs
