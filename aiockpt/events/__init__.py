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

# The schema and the dispatcher are for aiockpt's own use; the names of __all__ are public.
from ._dispatch import EventDispatcher as EventDispatcher
from ._dispatch import EventHandler
from ._dispatch import logger as logger
from ._group import process_group_info
from ._handlers import ENTRY_POINT_GROUP, JsonLinesHandler, ScopeTracker, entry_point_handlers
from ._handlers import ScopeFactory as ScopeFactory
from ._schema import EVENT_NAMES as EVENT_NAMES
from ._schema import EVENTS as EVENTS
from ._schema import Event, RecordedError
from ._schema import EventKind as EventKind
from ._schema import error_info as error_info

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
