"""Structured events: every checkpoint operation as data.

Each operation (a save, a load) gets a uuid shared by all of its events: ``save.start``, the
phases (``save.staged`` in the trainer; ``save.written`` and ``save.committed`` in the daemon),
then ``save.end`` or ``save.exception``. Events made in the daemon travel up the pipe and are
delivered in the trainer, in order. Every event goes to the ``aiockpt`` logger and to each
handler; a handler that raises is logged once and keeps being called.
"""

from __future__ import annotations

import json
import logging
import time as _time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Event", "EventHandler", "process_group_info"]

logger = logging.getLogger("aiockpt")

EventHandler = Callable[["Event"], Any]

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
    }
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
    where: str = "trainer"
    error: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), default=str)


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


def process_group_info(group: Any = None) -> dict[str, Any]:
    """Backend, name, size and this rank of ``group`` (the default group when None is given and
    torch.distributed is initialized); empty without torch.distributed."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed support
        return {}
    if not dist.is_available() or not dist.is_initialized():
        return {}
    pg = group if group is not None else dist.group.WORLD
    return {
        "backend": str(dist.get_backend(pg)),
        "name": dist._get_process_group_name(pg),
        "size": dist.get_world_size(pg),
        "rank": dist.get_rank(pg),
    }


class EventDispatcher:
    """Fills in the run's identity, logs, and calls handlers without letting them break a save."""

    def __init__(
        self,
        handlers: Iterable[EventHandler] = (),
        *,
        rank: int = 0,
        world_size: int = 1,
        process_group: dict[str, Any] | None = None,
    ) -> None:
        self.handlers = list(handlers)
        self.rank = rank
        self.world_size = world_size
        self.process_group = dict(process_group or {})
        self._failed: set[int] = set()

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
    ) -> Event:
        if isinstance(error, BaseException):
            error = error_info(error)
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
            where=where,
            error=error,
        )
        self.dispatch(event)
        return event

    def dispatch(self, event: Event) -> None:
        if event.name.endswith(".exception"):
            assert event.error is not None
            logger.error(
                "%s step=%s uuid=%s: %s\n%s",
                event.name,
                event.step,
                event.uuid,
                event.error["message"],
                event.error["traceback"],
            )
        elif logger.isEnabledFor(logging.DEBUG if not _is_end(event.name) else logging.INFO):
            logger.log(
                logging.INFO if _is_end(event.name) else logging.DEBUG,
                "%s step=%s uuid=%s duration_s=%s nbytes=%s",
                event.name,
                event.step,
                event.uuid,
                event.duration_s,
                event.nbytes,
            )
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


def _is_end(name: str) -> bool:
    return name.endswith(".end") or name in ("daemon.exit", "retention.delete")
