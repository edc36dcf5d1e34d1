"""The dispatcher: fills in the run's identity, logs each event, and calls the handlers
without letting them break a save."""

from __future__ import annotations

import logging
import time as _time
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any

from ..errors import CALLER_ERRORS, CheckpointError
from ._schema import EVENT_NAMES, EVENTS, Event, error_info

logger = logging.getLogger("aiockpt")

#: A handler is any callable taking an :class:`Event`; what it returns is ignored.
EventHandler = Callable[[Event], object]

#: The fields the dispatcher fills in itself or emit() names: the rest of the event's fields
#: are emit()'s ``**fields``.
_FILLED = frozenset(
    {"name", "uuid", "step", "rank", "world_size", "process_group", "time", "error"}
)
_FIELDS = frozenset(f.name for f in fields(Event)) - _FILLED
#: The fields on an event's log line, in order, when set.
_LOGGED = ("step", "uuid", *(f.name for f in fields(Event) if f.metadata.get("logged")))


class EventDispatcher:
    """Fills in the run's identity, logs, and calls handlers without letting them break a save.

    It also keeps the promise that every ``*.start`` is followed by exactly one ``*.end`` or
    ``*.exception``: :meth:`close` ends what is still open with an exception event.
    """

    def __init__(
        self,
        handlers: Iterable[EventHandler] = (),
        *,
        rank: int = 0,
        world_size: int = 1,
        process_group: dict[str, Any] | None = None,
    ) -> None:
        self.handlers = list(handlers)
        for h in self.handlers:
            if not callable(h):
                raise TypeError(f"an event handler must be callable, not {type(h).__name__}")
        self.rank = rank
        self.world_size = world_size
        self.process_group = dict(process_group or {})
        self._failed: set[int] = set()
        # uuid -> (operation, step, monotonic start) of operations that have not ended
        self._open: dict[str, tuple[str, int | None, float]] = {}

    def emit(
        self,
        name: str,
        *,
        uuid: str | None = None,
        step: int | None = None,
        error: BaseException | dict[str, str] | None = None,
        time: float | None = None,
        **fields: Any,
    ) -> Event:
        """Make the event ``name`` of this rank and dispatch it. ``fields`` are the rest of
        the event's fields (see :class:`Event`), and only those; an ``error`` goes with an
        ``*.exception`` event, and only with one."""
        unknown = sorted(set(fields) - _FIELDS)
        if unknown:
            raise TypeError(f"emit() got an unexpected keyword argument {unknown[0]!r}")
        if name not in EVENT_NAMES:
            raise ValueError(f"unknown event name {name!r}")
        if (error is None) == name.endswith(".exception"):
            raise ValueError(f"{name}: an error goes with exception events, and only with them")
        if isinstance(error, BaseException):
            error = error_info(error)
        op, _, phase = name.partition(".")
        if uuid is not None and phase == "start":
            self._open[uuid] = (op, step, _time.monotonic())
        elif uuid is not None and phase in ("end", "exception"):
            started = self._open.pop(uuid, None)
            # The whole operation's duration, for ends whose emitter did not time them.
            if fields.get("duration_s") is None and started is not None:
                fields["duration_s"] = _time.monotonic() - started[2]
        event = Event(
            name=name,
            uuid=uuid,
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            process_group=self.process_group,
            time=_time.time() if time is None else time,
            error=error,
            **fields,
        )
        self.dispatch(event)
        return event

    def dispatch(self, event: Event) -> None:
        _log(event)
        for handler in self.handlers:
            try:
                handler(event)
            except Exception:
                if id(handler) not in self._failed:
                    self._failed.add(id(handler))
                    logger.exception(
                        "event handler %r raised; it is still called, later errors are not logged",
                        handler,
                    )

    def open_operations(self) -> list[str]:
        """Uuids of operations that started and have not ended."""
        return list(self._open)

    def close(self) -> None:
        """End every operation still open with an ``*.exception`` event, so no scope leaks."""
        for uuid, (op, step, _) in list(self._open.items()):
            err = CheckpointError(
                f"the manager closed before this {op} (step {step}, uuid {uuid}) ended"
            )
            self.emit(f"{op}.exception", uuid=uuid, step=step, error=err)


def _caller_error_types() -> frozenset[str]:
    """The qualified names of the caller's errors and of every subclass of them in aiockpt."""
    names, stack = set(), list(CALLER_ERRORS)
    while stack:
        cls = stack.pop()
        names.add(f"{cls.__module__}.{cls.__qualname__}")
        stack.extend(cls.__subclasses__())
    return frozenset(names)


_CALLER_ERROR_TYPES = _caller_error_types()


def _log(event: Event) -> None:
    exception = event.name.endswith(".exception")
    kind = EVENTS.get(event.name)
    level = kind.level if kind is not None else logging.ERROR if exception else logging.DEBUG
    if exception and event.error is not None and event.error.get("type") in _CALLER_ERROR_TYPES:
        level = logging.DEBUG  # a mistake of the caller's, who gets the exception anyway
    if not logger.isEnabledFor(level):
        return
    parts = [event.name]
    for key in _LOGGED:
        value = getattr(event, key)
        if value is not None:
            parts.append(f"{key}={value:.6f}" if key == "duration_s" else f"{key}={value}")
    parts.append(f"rank={event.rank}")
    msg = " ".join(parts)
    if event.detail is not None:
        msg = f"{msg}: {event.detail}"
    if event.error is not None:
        # Every error of an operation is raised to its caller (a load's, a save() or its
        # handle): that is the report, with its traceback. The log says it in one line at
        # ERROR; the traceback stays in the event (record.aiockpt_event, the JSON lines),
        # and is logged only at DEBUG.
        msg = f"{msg}: {event.error['message']}"
        if level == logging.DEBUG:
            msg = f"{msg}\n{event.error['traceback'].rstrip()}"
    # The event rides along on the record for logging handlers that want the data.
    logger.log(level, "%s", msg, extra={"aiockpt_event": event})
