"""core/events: the vocabulary both machines share. Every event and action is a frozen
value of exactly one of the two unions (a class missing from its union would be fed or
answered without the type checker seeing it), and the states say whose they are."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from extproc.core import events as E

_CLASSES = [c for c in vars(E).values() if isinstance(c, type) and dataclasses.is_dataclass(c)
            and c.__module__ == E.__name__]
EVENTS = set(typing.get_args(E.Event))
ACTIONS = set(typing.get_args(E.Action))


def test_every_class_of_the_module_is_an_event_or_an_action_not_both() -> None:
    assert not EVENTS & ACTIONS
    assert {c.__name__ for c in _CLASSES} == {c.__name__ for c in EVENTS | ACTIONS}


@pytest.mark.parametrize("cls", sorted(_CLASSES, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_every_event_and_action_is_frozen(cls: type) -> None:
    params = getattr(cls, "__dataclass_params__")  # noqa: B009 (the dataclass's own record)
    assert params.frozen, cls
    assert hasattr(cls, "__slots__"), cls  # one per message: no per-instance dict


def test_an_event_cannot_be_changed_after_it_was_fed() -> None:
    ev = E.ResponseBody(b"x", end_of_stream=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.end_of_stream = True  # type: ignore[misc]
    assert E.ResponseBody(b"x", False) == ev  # a value: equal by content


def test_states_name_their_role() -> None:
    for s in E.State:
        role = s.name.split("_", 1)[0].lower()
        assert role in ("gate", "guard") and s.value.startswith(role + "_"), s
    assert len({s.value for s in E.State}) == len(E.State)
    assert len({k.value for k in E.TimerKind}) == len(E.TimerKind)
