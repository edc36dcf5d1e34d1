"""What the daemon sends up the pipe to its trainer, and how errors travel up it."""

from __future__ import annotations

import time
import traceback
from typing import Any

from .._core.pipe import PipeEnd
from .._core.protocol import EventMsg
from ..errors import CheckpointError


def remote_error(exc: BaseException) -> BaseException:
    """The exception to send up the pipe: aiockpt errors as they are, others wrapped."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if isinstance(exc, CheckpointError):
        err: BaseException = exc
    else:
        err = CheckpointError(f"the daemon failed: {type(exc).__name__}: {exc}")
    err.remote_traceback = tb  # type: ignore[attr-defined]
    err.__traceback__ = None
    err.__cause__ = err.__context__ = None
    return err


class Outbox:
    """What the daemon's threads send up: once the trainer is gone, sends are dropped, so the
    daemon finishes what is staged quietly instead of failing on every message."""

    def __init__(self, pipe: PipeEnd) -> None:
        self.pipe = pipe
        self.peer_gone = False

    def send(self, msg: object) -> None:
        """Send ``msg``, unless the trainer is gone."""
        if self.peer_gone:
            return
        try:
            self.pipe.send(msg)
        except (OSError, EOFError, ValueError):
            self.peer_gone = True

    def event(self, name: str, uuid: str | None, step: int | None, **fields: Any) -> None:
        """Send an event for the trainer's dispatcher, stamped now unless ``time`` is given."""
        fields.setdefault("time", time.time())
        self.send(EventMsg(name, uuid, step, fields))
