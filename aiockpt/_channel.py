"""The frames exchanged with the daemon, and an awaitable wrapper around the pipe.

Frames are small pickled dataclasses: layouts, JSON-able trees and replies, never tensor bytes
(those travel through shared memory). Both ends are this package, so pickle is safe here; what
comes from *storage* is never unpickled.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import anyio

PROTOCOL = 1

# --------------------------------------------------------------------------- trainer -> daemon


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Everything the daemon needs to start; sent once, answered by :class:`Ready`."""

    url: str
    storage_options: dict[str, Any]
    retention: Any  # a retention policy or None; pickled by reference
    rank: int = 0
    world_size: int = 1
    trainer_pid: int = 0
    collect_partials: bool = True
    dist: Any = None  # multi-rank coordination settings, see _dist


@dataclass(frozen=True, slots=True)
class LayoutMsg:
    """A shard layout, sent once per daemon and then named by ``id``."""

    id: int
    data_start: int
    file_size: int
    #: (name, safetensors dtype, shape, start, end) in file order; offsets relative to data_start.
    specs: tuple[tuple[str, str, tuple[int, ...], int, int], ...]


@dataclass(frozen=True, slots=True)
class SaveReq:
    uuid: str
    step: int
    slab: str
    slab_size: int
    layout_id: int
    layout: LayoutMsg | None
    tree: Any
    metrics: dict[str, Any]
    metadata: dict[str, Any]
    forget: tuple[str, ...] = ()
    #: State-tree fragments the daemon does not hold yet, by id: the tree refers to a fragment
    #: by a reference string and the daemon splices in its encoded text (_format.encode_tree).
    fragments: dict[int, Any] = field(default_factory=dict)
    #: Fragments and layouts no later request will refer to.
    forget_fragments: tuple[int, ...] = ()
    forget_layouts: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Request:
    """A read-side request (list, load, …) answered by a :class:`Reply` with the same ``id``."""

    id: int
    op: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Stop:
    """Finish what is queued, then exit."""


# --------------------------------------------------------------------------- daemon -> trainer


@dataclass(frozen=True, slots=True)
class Ready:
    pid: int
    protocol: int = PROTOCOL
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class SlabFree:
    slab: str


@dataclass(frozen=True, slots=True)
class SaveDone:
    uuid: str
    info: dict[str, Any] | None = None
    deleted: tuple[int, ...] = ()
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    id: int
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class EventMsg:
    name: str
    uuid: str | None
    step: int | None
    fields: dict[str, Any]


# --------------------------------------------------------------------------- the pipe


class Channel:
    """One end of the pipe: thread-safe ``send``, awaitable ``recv`` (asyncio and trio)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()

    def send(self, msg: object) -> None:
        with self._send_lock:
            self.conn.send(msg)

    async def recv(self) -> object:
        """The next frame. Raises EOFError once the other end is gone."""
        while not self.conn.poll():
            await anyio.wait_readable(self.conn.fileno())
        return self.conn.recv()

    def close(self) -> None:
        self.conn.close()
