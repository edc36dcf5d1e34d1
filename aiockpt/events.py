"""Structured events: every checkpoint operation as data.

Each operation (a save, a load) gets a uuid shared by all of its events: ``save.start``, the
phases (``save.staged`` in the trainer; ``save.written`` and ``save.committed`` in the daemon),
then exactly one of ``save.end`` or ``save.exception``. Events made in the daemon travel up the
pipe and are delivered in the trainer, in order. Every event goes to the ``aiockpt`` logger and
to each handler; a handler that raises is logged once and keeps being called.

Handlers come from code (``AsyncCheckpointManager(event_handlers=[...])``) and from the
entry-point group ``aiockpt.event_handlers``, whose entries name zero-argument factories that
return a handler. Two handlers are built in: :class:`JsonLinesHandler` and :class:`ScopeTracker`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time as _time
import traceback
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, fields
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from .errors import CALLER_ERRORS, CheckpointError

__all__ = [
    "ENTRY_POINT_GROUP",
    "Event",
    "EventHandler",
    "JsonLinesHandler",
    "RecordedError",
    "ScopeTracker",
    "entry_point_handlers",
    "process_group_info",
]

logger = logging.getLogger("aiockpt")

#: Entry-point group of handler factories.
ENTRY_POINT_GROUP = "aiockpt.event_handlers"

#: A handler is any callable taking an :class:`Event`; what it returns is ignored.
EventHandler = Callable[["Event"], object]

EVENT_NAMES = frozenset(
    {
        "save.start",
        "save.staged",
        "save.written",
        "save.committed",
        "save.end",
        "save.exception",
        "load.start",
        "load.end",
        "load.exception",
        "retention.delete",
        "daemon.spawn",
        "daemon.exit",
        "daemon.restart",
        "shm.swept",
        "lease.acquired",
        "lease.takeover",
        "lease.unguarded",
        "lease.lapsed",
        "lease.regained",
        "tier.committed",
        "tier.delete",
        "tier.failed",
        "tier.incomplete",
        "load.tier",
    }
)

#: Events worth a line at INFO: ends of operations and the daemon's life and deletions.
_INFO_EVENTS = frozenset(
    {
        "save.end",
        "load.end",
        "retention.delete",
        "daemon.spawn",
        "daemon.exit",
        "shm.swept",
        "lease.acquired",
        "lease.regained",
    }
)
#: Events worth a WARNING: something the user should look at, though nothing failed.
_WARNING_EVENTS = frozenset(
    {"daemon.restart", "lease.takeover", "lease.unguarded", "lease.lapsed", "tier.failed"}
)


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened. Serializes to one JSON line with :meth:`to_json`."""

    name: str
    uuid: str | None
    step: int | None
    rank: int
    world_size: int
    process_group: dict[str, Any] = field(default_factory=dict)
    time: float = 0.0
    duration_s: float | None = None
    nbytes: int | None = None
    #: On ``load.end``: the bytes this rank's load read from storage.
    read_nbytes: int | None = None
    #: On ``save.written``: the bytes this rank wrote, less than ``nbytes`` when blocks that a
    #: kept checkpoint already holds were referred to instead (deduplication).
    written_nbytes: int | None = None
    #: On ``save.staged``: the bytes copied into staging, less than ``nbytes`` when
    #: ``skip_unchanged`` found tensors the staging slab still held.
    copied_nbytes: int | None = None
    #: On ``save.committed``: the storage operations this rank's daemon made for the save up
    #: to its commit, by kind (``write_file``, ``exists``, ``list_dir``, ...).
    requests: dict[str, int] | None = None
    where: str = "trainer"
    error: dict[str, str] | None = None
    #: On ``lease.*``: the generation of the root's lease this manager holds.
    generation: int | None = None
    #: Words for people: on ``lease.takeover``, whose lease was taken over and why; on
    #: ``lease.lapsed``, what failed the renewals.
    detail: str | None = None
    #: On ``tier.*`` and ``load.tier``: the tier concerned ("local", "peer", "root").
    tier: str | None = None

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


def process_group_info(group: Any = None) -> dict[str, Any]:
    """Backend, name, size and this process's rank in ``group``.

    ``group`` is the group given to the manager; only when none was given is it the default
    group (and then only when torch.distributed is initialized, else the result is empty). Never
    the default group's values for a group that was given: DCP made that mistake (PyTorch PR
    139428 logged the default group's backend instead of the caller's).
    """
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed support
        if group is not None:
            raise ValueError(
                "a process group was given, but torch.distributed is missing"
            ) from None
        return {}
    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            return {}
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        if type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:
            # what new_group() returns in a process outside the group
            raise ValueError("this process is not a member of the process group given")
        raise TypeError(
            f"process_group must be a torch.distributed ProcessGroup, not {type(group).__name__}"
        )
    elif not dist.is_initialized():
        raise ValueError("a process group was given, but torch.distributed is not initialized")
    return {
        "backend": str(dist.get_backend(group)),
        "name": dist._get_process_group_name(group),
        "size": dist.get_world_size(group),
        "rank": dist.get_rank(group),
    }


# --------------------------------------------------------------------------- dispatch


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
        duration_s: float | None = None,
        nbytes: int | None = None,
        where: str = "trainer",
        error: BaseException | dict[str, str] | None = None,
        time: float | None = None,
        read_nbytes: int | None = None,
        generation: int | None = None,
        detail: str | None = None,
        written_nbytes: int | None = None,
        requests: dict[str, int] | None = None,
        copied_nbytes: int | None = None,
        tier: str | None = None,
    ) -> Event:
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
            if duration_s is None and started is not None:
                duration_s = _time.monotonic() - started[2]
        event = Event(
            name=name,
            uuid=uuid,
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            process_group=self.process_group,
            time=_time.time() if time is None else time,
            duration_s=duration_s,
            nbytes=nbytes,
            read_nbytes=read_nbytes,
            written_nbytes=written_nbytes,
            copied_nbytes=copied_nbytes,
            requests=requests,
            where=where,
            error=error,
            generation=generation,
            detail=detail,
            tier=tier,
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
    if event.name.endswith(".exception"):
        caller = event.error is not None and event.error.get("type") in _CALLER_ERROR_TYPES
        level = logging.DEBUG if caller else logging.ERROR
    elif event.name in _WARNING_EVENTS:
        level = logging.WARNING
    elif event.name in _INFO_EVENTS:
        level = logging.INFO
    else:
        level = logging.DEBUG
    if not logger.isEnabledFor(level):
        return
    parts = [event.name]
    for key in (
        "step",
        "uuid",
        "duration_s",
        "nbytes",
        "read_nbytes",
        "written_nbytes",
        "copied_nbytes",
        "generation",
    ):
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


# --------------------------------------------------------------------------- built-in handlers


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


# --------------------------------------------------------------------------- entry points

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
