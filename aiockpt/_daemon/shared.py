"""What the daemon's threads share, each piece behind its own lock."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from .._core.protocol import WindowReady
from .._core.shm import Segment


class InFlight:
    """The steps of the saves received and not finished yet.

    The main thread adds a step as its request arrives, before the writer sees it, and the
    writer drops it once the save is over: retention never deletes such a step, and partial
    collection never removes its directory, even while the writer is still busy with an
    earlier save."""

    def __init__(self) -> None:
        self._steps: set[int] = set()
        self._lock = threading.Lock()

    def add(self, step: int) -> None:
        """A save of ``step`` was received."""
        with self._lock:
            self._steps.add(step)

    def discard(self, step: int) -> None:
        """The save of ``step`` is over, committed or not."""
        with self._lock:
            self._steps.discard(step)

    def snapshot(self) -> frozenset[int]:
        """The steps in flight now."""
        with self._lock:
            return frozenset(self._steps)


class Slabs:
    """The trainer's shared-memory slabs this daemon has mapped, by name: saves read them, and
    a load may be lent one to fill."""

    def __init__(self) -> None:
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()

    def get(self, name: str, size: int) -> Segment:
        """The slab ``name`` mapped with at least ``size`` bytes (mapped again if it grew)."""
        with self._lock:
            seg = self._segments.get(name)
            if seg is None or seg.size < size:
                if seg is not None:
                    seg.close()
                seg = self._segments[name] = Segment.attach(name, size)
            return seg

    def forget(self, names: tuple[str, ...]) -> None:
        """Unmap slabs the trainer has unlinked."""
        with self._lock:
            for name in names:
                seg = self._segments.pop(name, None)
                if seg is not None:
                    seg.close()

    def names(self) -> list[str]:
        """The names of the slabs mapped now."""
        with self._lock:
            return list(self._segments)

    def close(self) -> None:
        """Unmap every slab (their names stay known to :meth:`names`)."""
        with self._lock:
            for seg in self._segments.values():
                seg.close()


class Windows:
    """The windows of saves staged in pieces (:class:`WindowReady`), from the main thread to
    the writer: one queue per save. A window of a save the writer is done with, or that
    arrives after the trainer is gone, is handed straight back (``free``)."""

    def __init__(self, free: Callable[[str], None]) -> None:
        self._free = free
        self._queues: dict[str, queue.SimpleQueue[WindowReady | None]] = {}
        self._done: dict[str, None] = {}  # the last saves finished, oldest first
        self._closed = False
        self._lock = threading.Lock()

    def _queue(self, uuid: str) -> queue.SimpleQueue[WindowReady | None]:
        q = self._queues.get(uuid)
        if q is None:
            q = self._queues[uuid] = queue.SimpleQueue()
            if self._closed:
                q.put(None)
        return q

    def put(self, msg: WindowReady) -> None:
        """A window arrived (main thread)."""
        with self._lock:
            if msg.uuid not in self._done:
                self._queue(msg.uuid).put(msg)
                return
        if msg.slab:
            self._free(msg.slab)

    def take(self, uuid: str) -> WindowReady | None:
        """The next window of save ``uuid``, waiting for it; None once the trainer is gone."""
        with self._lock:
            q = self._queue(uuid)
        return q.get()

    def finish(self, uuid: str) -> None:
        """The writer is done with save ``uuid``: its windows still queued, and any that come
        later, are handed back."""
        with self._lock:
            self._done[uuid] = None
            if len(self._done) > 64:  # a late window comes before the trainer's next save
                del self._done[next(iter(self._done))]
            q = self._queues.pop(uuid, None)
        while q is not None and not q.empty():
            msg = q.get()
            if msg is not None and msg.slab:
                self._free(msg.slab)

    def close(self) -> None:
        """The trainer is gone: a save waiting for a window, or that will, gets None."""
        with self._lock:
            self._closed = True
            for q in self._queues.values():
                q.put(None)
