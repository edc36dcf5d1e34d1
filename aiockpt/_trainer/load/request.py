"""How the trainer asks its daemon for a load's bytes: one request per load mode (see
``_core/protocol/load.py``), each naming what it reads by a :class:`LoadAsk`."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..._core.protocol import (
    CappedLoadReq,
    CappedWindowReq,
    LoadAsk,
    LoadReply,
    ReadReq,
    SlabRef,
    StreamReq,
    StreamWindowReq,
)

#: Sends this rank's load request ``kind`` with ``fields`` (every field but its id) to the
#: daemon and returns the reply.
Read = Callable[..., Awaitable[LoadReply]]


@dataclass(frozen=True, slots=True)
class Into:
    """What a ``load(into=...)`` was asked: the step, the target, whether its keys must
    match, the key paths to read (``required``: the caller's ``keys``, each of which must
    name something), and whether a capped load may copy a window before every checksum has
    passed (not ``atomic``)."""

    step: int | None
    into: Any
    strict: bool
    keys: tuple[str, ...] | None
    required: bool
    atomic: bool


@dataclass(frozen=True, slots=True)
class Windowed:
    """The requests of one load in windows of at most ``window`` bytes of what ``ask``
    names: checked whole first (:class:`CappedLoadReq`), or streamed, each window checked
    as it is read (:class:`StreamReq`). ``name``: the stream's, or the checking pass's
    answered early."""

    ask: LoadAsk
    window: int
    stream: bool
    name: str

    @classmethod
    def of(cls, ask: LoadAsk, window: int, stream: bool) -> Windowed:
        return cls(ask, window, stream, uuid.uuid4().hex)

    def start(self, slab: SlabRef) -> tuple[type[ReadReq], dict[str, Any]]:
        """The first request: the plan and the windows (capped: every window read and
        checked after the answer, through ``slab``)."""
        if self.stream:
            return StreamReq, {"ask": self.ask, "window": self.window, "name": self.name}
        fields = {"ask": self.ask, "slab": slab, "window": self.window, "early": self.name}
        return CappedLoadReq, fields

    def part(self, step: int, slab: SlabRef, i: int) -> tuple[type[ReadReq], dict[str, Any]]:
        """The request of window ``i`` of the load of ``step``, read into ``slab``."""
        if self.stream:
            return StreamWindowReq, {"name": self.name, "slab": slab, "part": i}
        ask = dataclasses.replace(self.ask, step=step)
        return CappedWindowReq, {"ask": ask, "slab": slab, "window": self.window, "part": i}
