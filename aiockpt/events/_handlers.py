"""The built-in handlers (:class:`JsonLinesHandler`, :class:`ScopeTracker`) and those that
installed distributions offer through entry points."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from ._dispatch import EventHandler, logger
from ._schema import Event, RecordedError

#: Entry-point group of handler factories.
ENTRY_POINT_GROUP = "aiockpt.event_handlers"


class JsonLinesHandler:
    """Appends each event to ``path`` as one JSON object per line.

    Each event is one ``write`` to a file opened with ``O_APPEND`` (opened and closed per event):
    nothing is buffered, lines from several processes sharing the file do not interleave, and
    a rotated-away file is simply created again.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        # Fail now, not at the first event, when the file cannot be opened.
        os.close(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))

    def __call__(self, event: Event) -> None:
        data = (event.to_json() + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return f"JsonLinesHandler({self.path!r})"


ScopeFactory = Callable[[Event], AbstractContextManager[Any]]


class ScopeTracker:
    """Opens a scope (any context manager, e.g. a tracing span) per operation, keyed by uuid.

    On ``save.start``/``load.start`` it enters ``factory(event)``; on ``*.end`` it exits it
    cleanly; on ``*.exception`` it exits it with a :class:`RecordedError` rebuilt from the
    event's error, so the scope records the failure. Scopes are entered and exited on the
    thread and task that deliver events, not the caller's: do not use a context manager that
    sets context variables (such as a "current span") there.
    """

    def __init__(self, factory: ScopeFactory) -> None:
        if not callable(factory):
            raise TypeError(f"factory must be callable, not {type(factory).__name__}")
        self.factory = factory
        self._scopes: dict[str, tuple[AbstractContextManager[Any], Any]] = {}
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        if event.uuid is None:
            return
        _, _, phase = event.name.partition(".")
        if phase == "start":
            with self._lock:
                if event.uuid in self._scopes:
                    raise ValueError(f"{event.name}: uuid {event.uuid} already has an open scope")
            cm = self.factory(event)
            value = cm.__enter__()
            with self._lock:
                self._scopes[event.uuid] = (cm, value)
        elif phase in ("end", "exception"):
            with self._lock:
                entry = self._scopes.pop(event.uuid, None)
            if entry is None:
                return  # its start was not seen (the tracker was added late) or failed to enter
            cm = entry[0]
            if phase == "end":
                cm.__exit__(None, None, None)
            else:
                exc = (
                    RecordedError.from_event(event)
                    if event.error is not None
                    else RecordedError("unknown", f"{event.name} carried no error", "")
                )
                try:  # raise it once so that it carries a real traceback object
                    raise exc
                except RecordedError:
                    pass
                cm.__exit__(type(exc), exc, exc.__traceback__)

    def scope(self, uuid: str) -> Any:
        """What the open scope of ``uuid`` returned from ``__enter__`` (a span, to annotate)."""
        with self._lock:
            try:
                return self._scopes[uuid][1]
            except KeyError:
                raise KeyError(f"no open scope for uuid {uuid}") from None

    def open_scopes(self) -> list[str]:
        """Uuids whose scope is entered and not yet exited."""
        with self._lock:
            return list(self._scopes)

    def __repr__(self) -> str:
        return f"ScopeTracker({self.factory!r})"


_factories: dict[str, Callable[[], EventHandler]] = {}

_factories_lock = threading.Lock()


def entry_point_handlers(eps: Iterable[EntryPoint] | None = None) -> list[EventHandler]:
    """One new handler from each factory in the ``aiockpt.event_handlers`` entry points.

    Factories are imported on first use and cached; each call makes new handlers (a manager
    calls this once, when it opens). An entry point that fails to import, or whose factory
    raises or returns something that is not callable, is logged at ERROR and left out: an
    observer must never stop training from checkpointing.
    """
    if eps is None:
        eps = entry_points(group=ENTRY_POINT_GROUP)
    handlers: list[EventHandler] = []
    for ep in sorted(eps, key=lambda e: e.name):
        key = f"{ep.name}={ep.value}"
        try:
            with _factories_lock:
                factory = _factories.get(key)
            if factory is None:
                factory = ep.load()
                if not callable(factory):
                    raise TypeError(f"{ep.value} is a {type(factory).__name__}, not a factory")
                with _factories_lock:
                    _factories[key] = factory
            handler = factory()
            if not callable(handler):
                raise TypeError(
                    f"{ep.value}() returned a {type(handler).__name__}, not a callable handler"
                )
        except Exception:
            logger.exception(
                "the event handler entry point %r (%s) in %s failed; it is left out",
                ep.name,
                ep.value,
                ENTRY_POINT_GROUP,
            )
            continue
        handlers.append(handler)
    return handlers
