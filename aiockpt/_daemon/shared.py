"""What the daemon's threads share, each piece behind its own lock."""

from __future__ import annotations

import threading

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
