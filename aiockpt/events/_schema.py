"""The event schema: every event's name, the process that makes it and the level it is
logged at (:data:`EVENTS`), and every field an event carries (:class:`Event`). This is its one
definition: the dispatcher checks what it emits against it, and docs/events.md's tables are
checked against it by the tests."""

from __future__ import annotations

import json
import traceback
from dataclasses import asdict, dataclass, field, fields
from logging import DEBUG, ERROR, INFO, WARNING
from typing import Any

__all__ = ["EVENTS", "EVENT_NAMES", "Event", "EventKind", "RecordedError", "error_info"]


@dataclass(frozen=True, slots=True)
class EventKind:
    """What the schema says of an event name besides its fields."""

    #: Where the event is made: ``"trainer"`` or ``"daemon"`` (a daemon's events are
    #: delivered in the trainer all the same).
    where: str
    #: The level of its log line (an ``*.exception`` of a mistake of the caller's is logged
    #: at DEBUG instead: the caller gets the exception anyway).
    level: int


_T, _D = "trainer", "daemon"

#: Every event, by name.
EVENTS: dict[str, EventKind] = {
    "save.start": EventKind(_T, DEBUG),
    "save.staged": EventKind(_T, DEBUG),
    "save.written": EventKind(_D, DEBUG),
    "save.committed": EventKind(_D, DEBUG),
    "save.end": EventKind(_T, INFO),
    "save.exception": EventKind(_T, ERROR),
    "load.start": EventKind(_T, DEBUG),
    "load.end": EventKind(_T, INFO),
    "load.exception": EventKind(_T, ERROR),
    "retention.delete": EventKind(_D, INFO),
    "daemon.spawn": EventKind(_D, INFO),
    "daemon.exit": EventKind(_D, INFO),
    "daemon.restart": EventKind(_D, WARNING),
    "shm.swept": EventKind(_T, INFO),
    "lease.acquired": EventKind(_T, INFO),
    "lease.takeover": EventKind(_T, WARNING),
    "lease.unguarded": EventKind(_T, WARNING),
    "lease.lapsed": EventKind(_D, WARNING),
    "lease.regained": EventKind(_D, INFO),
    "tier.adopted": EventKind(_D, WARNING),
    "tier.committed": EventKind(_D, DEBUG),
    "tier.delete": EventKind(_D, INFO),
    "tier.failed": EventKind(_D, WARNING),
    "tier.incomplete": EventKind(_D, INFO),
    "tier.replicated": EventKind(_D, DEBUG),
    "load.tier": EventKind(_D, DEBUG),
}
EVENT_NAMES = frozenset(EVENTS)

#: The metadata of a field whose value, when set, goes on the event's log line.
LOGGED = {"logged": True}


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened. Serializes to one JSON line with :meth:`to_json`.

    Its fields are the schema's: docs/events.md describes each (a test holds the two to the
    same list); those marked ``LOGGED`` go on the event's log line when set."""

    name: str
    uuid: str | None
    step: int | None
    rank: int
    world_size: int
    process_group: dict[str, Any] = field(default_factory=dict)
    time: float = 0.0
    duration_s: float | None = field(default=None, metadata=LOGGED)
    nbytes: int | None = field(default=None, metadata=LOGGED)
    #: On ``load.end``: the bytes this rank's load read from storage.
    read_nbytes: int | None = field(default=None, metadata=LOGGED)
    #: On ``save.written``: the bytes this rank wrote, less than ``nbytes`` when blocks that a
    #: kept checkpoint already holds were referred to instead (deduplication).
    written_nbytes: int | None = field(default=None, metadata=LOGGED)
    #: On ``save.staged``: the bytes copied into staging, less than ``nbytes`` when
    #: ``skip_unchanged`` found tensors the staging slab still held.
    copied_nbytes: int | None = field(default=None, metadata=LOGGED)
    #: On ``save.committed``: the storage operations this rank's daemon made for the save up
    #: to its commit, by kind (``write_file``, ``exists``, ``list_dir``, ...).
    requests: dict[str, int] | None = None
    where: str = "trainer"
    error: dict[str, str] | None = None
    #: On ``lease.*``: the generation of the root's lease this manager holds.
    generation: int | None = field(default=None, metadata=LOGGED)
    #: Words for people: on ``lease.takeover``, whose lease was taken over and why; on
    #: ``lease.lapsed``, what failed the renewals.
    detail: str | None = None
    #: On ``tier.*`` and ``load.tier``: the tier concerned ("local", "peer" or "root").
    tier: str | None = field(default=None, metadata=LOGGED)

    def to_dict(self) -> dict[str, Any]:
        """The event as a plain dict of its fields."""
        return asdict(self)

    def to_json(self) -> str:
        """One line of JSON (no newline inside: strings escape theirs)."""
        return json.dumps(self.to_dict(), separators=(",", ":"), default=str)

    @classmethod
    def from_json(cls, line: str) -> Event:
        """The event that :meth:`to_json` wrote; unknown keys are refused."""
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError(f"an event is a JSON object, not {type(data).__name__}")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown event fields: {sorted(unknown)}")
        return cls(**data)


def error_info(exc: BaseException) -> dict[str, str]:
    """The JSON form of an exception: type, message and formatted traceback."""
    remote = getattr(exc, "remote_traceback", None)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if remote:
        tb = f"{tb}\nRaised in the daemon:\n{remote}"
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": tb,
    }


class RecordedError(Exception):
    """An exception rebuilt from an event's ``error`` record, for code that wants an exception
    object (a tracing span's ``__exit__``). The original type is named, not re-created: events
    cross a process boundary and may name types the receiver cannot import."""

    def __init__(self, type_name: str, message: str, traceback_text: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.traceback_text = traceback_text

    @classmethod
    def from_event(cls, event: Event) -> RecordedError:
        """The error an ``*.exception`` event carries, as an exception to raise or inspect."""
        if event.error is None:
            raise ValueError(f"{event.name} carries no error")
        e = event.error
        return cls(e.get("type", "?"), e.get("message", ""), e.get("traceback", ""))
