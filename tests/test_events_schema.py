"""docs/events.md describes the event schema that aiockpt/events/_schema.py defines: the same
names, made where the schema says, logged at its levels, with the same fields."""

from __future__ import annotations

import logging
import re
from dataclasses import fields
from pathlib import Path

import pytest

from aiockpt.events import EVENTS, Event, EventDispatcher

DOC = Path(__file__).resolve().parent.parent / "docs" / "events.md"


def section_rows(title: str) -> list[list[str]]:
    """The cells of the first table under the heading ``title`` (its header row left out)."""
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    rows = []
    for line in text[start : end if end >= 0 else None].splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows[1:]


def names_in(cell: str) -> set[str]:
    """The event names a cell names in backquotes, ``*.end`` standing for every end."""
    found = set()
    for name in re.findall(r"`([a-z*]+\.[a-z]+)`", cell):
        op, _, phase = name.partition(".")
        found |= {n for n in EVENTS if n.endswith(f".{phase}")} if op == "*" else {name}
    return found


def test_the_events_table_lists_every_event_where_it_is_made():
    documented = {}
    for name_cell, _when, where in section_rows("The events"):
        for name in names_in(name_cell):
            documented[name] = where
    assert documented == {name: kind.where for name, kind in EVENTS.items()}


def test_the_fields_table_lists_every_field():
    documented = [name for row in section_rows("Fields") for name in re.findall(r"`(\w+)`", row[0])]
    assert sorted(documented) == sorted(f.name for f in fields(Event))


@pytest.mark.parametrize("level", ["INFO", "WARNING"])
def test_the_logging_table_gives_each_event_its_level(level):
    (cell,) = [events for lvl, events in section_rows("Logging") if lvl == level]
    expected = {n for n, kind in EVENTS.items() if kind.level == getattr(logging, level)}
    assert names_in(cell) == expected


def test_the_logging_table_names_every_debug_and_error_event():
    rows = dict(section_rows("Logging"))
    for level in ("DEBUG", "ERROR"):
        expected = {n for n, kind in EVENTS.items() if kind.level == getattr(logging, level)}
        assert expected <= names_in(rows[level])


def test_emit_takes_the_schemas_fields_and_no_other():
    events = EventDispatcher()
    event = events.emit("save.written", uuid="u", step=1, nbytes=8, written_nbytes=4)
    assert (event.nbytes, event.written_nbytes, event.where) == (8, 4, "trainer")
    with pytest.raises(TypeError, match="unexpected keyword argument 'nbites'"):
        events.emit("save.written", uuid="u", step=1, nbites=8)
