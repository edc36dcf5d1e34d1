"""CheckpointManager: the same manager for training loops that are not async.

It runs an :class:`~aiockpt.AsyncCheckpointManager` on an event loop of its own, in a thread
(anyio's blocking portal), and blocks the caller only for what the async API awaits: ``save``
returns once the snapshot is taken, and the write and commit go on in the background while
training continues, exactly as with the async manager.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal

from .._core.protocol import CheckpointInfo
from ..errors import ManagerClosedError
from ..events import EventHandler
from ..retention import RetentionPolicy
from .ledger import SaveHandle
from .manager import DEFAULT_LEASE_TTL, AsyncCheckpointManager

__all__ = ["CheckpointManager", "SyncSaveHandle"]


class SyncSaveHandle:
    """The pending commit of one save of a :class:`CheckpointManager`."""

    def __init__(self, handle: SaveHandle, portal: BlockingPortal) -> None:
        self._handle = handle
        self._portal = portal
        self._future: Future[CheckpointInfo] | None = None

    @property
    def step(self) -> int:
        """The step saved."""
        return self._handle.step

    def done(self) -> bool:
        """Whether the save has ended, committed or failed. The manager's own event loop runs
        in its thread, so this turns True as soon as the daemon answers, with no call needed."""
        return self._handle.done()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """Wait until the save is durable and committed; its :class:`CheckpointInfo`. Raises
        the save's error, or TimeoutError after ``timeout`` seconds (the save goes on)."""
        if self._future is None:
            self._future = self._portal.start_task_soon(self._handle.wait)
        return self._future.result(timeout)

    def __repr__(self) -> str:
        return repr(self._handle).replace("SaveHandle", "SyncSaveHandle", 1)


class CheckpointManager:
    """A blocking :class:`~aiockpt.AsyncCheckpointManager`: the same arguments and methods,
    called without ``await``. Use it as a context manager::

        with CheckpointManager(root, retention=LatestN(3)) as mgr:
            handle = mgr.save(step, state)   # returns once the snapshot is taken
            ...
            handle.result()                  # durable and committed
            state = mgr.load()

    Event handlers are called in the manager's own thread. ``on_sigterm`` is not offered: a
    signal handler must be installed by the main thread, and the manager runs in another.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        max_pending: int = 1,
        staging_memory: int | float | None = None,
        retention: RetentionPolicy | None = None,
        event_handlers: Iterable[EventHandler] = (),
        process_group: Any = None,
        start_timeout: float = 60.0,
        close_timeout: float | None = None,
        dist_timeout: float = 300.0,
        read_only: bool = False,
        takeover: bool = False,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        dedup: bool = True,
        skip_unchanged: bool = False,
    ) -> None:
        self._options: dict[str, Any] = {
            "storage_options": storage_options,
            "max_pending": max_pending,
            "staging_memory": staging_memory,
            "retention": retention,
            "event_handlers": list(event_handlers),
            "process_group": process_group,
            "start_timeout": start_timeout,
            "close_timeout": close_timeout,
            "dist_timeout": dist_timeout,
            "read_only": read_only,
            "takeover": takeover,
            "lease_ttl": lease_ttl,
            "dedup": dedup,
            "skip_unchanged": skip_unchanged,
        }
        self._root = root
        # Built here too, so bad arguments fail at once, as with the async manager; the one
        # that runs is built on the manager's loop when it opens.
        self._async = AsyncCheckpointManager(root, **self._options)
        self._loop: AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        self._context: AbstractContextManager[AsyncCheckpointManager] | None = None
        self._state = "new"

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> CheckpointManager:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> None:
        """Start the manager's event loop thread and open the manager on it."""
        if self._state != "new":
            raise ManagerClosedError(f"the manager is {self._state}; a manager opens once")
        self._state = "opening"
        self._loop = start_blocking_portal(backend="asyncio")
        self._portal = portal = self._loop.__enter__()
        try:
            self._async = portal.call(self._build)
            # One task enters and exits the manager (its task group must), whatever task
            # each later call runs in.
            self._context = portal.wrap_async_context_manager(self._async)
            self._context.__enter__()
        except BaseException as e:
            self._state = "closed"
            self._loop.__exit__(type(e), e, e.__traceback__)
            raise
        self._state = "open"

    async def _build(self) -> AsyncCheckpointManager:
        return AsyncCheckpointManager(self._root, **self._options)

    def close(self) -> None:
        """Wait for pending saves, stop the daemon, and end the event loop thread."""
        if self._state != "open":
            self._state = "closed"
            return
        self._state = "closed"
        assert self._context is not None
        assert self._loop is not None
        try:
            self._context.__exit__(None, None, None)
        finally:
            self._loop.__exit__(None, None, None)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._state != "open" or self._portal is None:
            raise ManagerClosedError(
                "the manager is not open; use `with CheckpointManager(...)`"
                if self._state == "new"
                else f"the manager is {self._state}"
            )
        if kwargs:
            return self._portal.call(lambda: fn(*args, **kwargs))
        return self._portal.call(fn, *args)

    # ----------------------------------------------------------------- the API

    @property
    def url(self) -> str:
        """The root's URL."""
        return self._async.url

    @property
    def rank(self) -> int:
        """This process's rank in the manager's process group (0 without one)."""
        return self._async.rank

    @property
    def world_size(self) -> int:
        """The number of ranks checkpointing together (1 without a process group)."""
        return self._async.world_size

    @property
    def daemon_pid(self) -> int | None:
        """The daemon's process id (see AsyncCheckpointManager.daemon_pid)."""
        return self._async.daemon_pid

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SyncSaveHandle:
        """Snapshot ``state`` and start writing it; returns once the state may be mutated."""
        handle = self._call(self._async.save, step, state, metrics=metrics, metadata=metadata)
        assert self._portal is not None
        return SyncSaveHandle(handle, self._portal)

    def wait(self) -> None:
        """Wait until every pending save has committed; raises the first failure."""
        self._call(self._async.wait)

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return self._call(self._async.steps)

    def latest_step(self) -> int | None:
        """The newest committed step, None when there is none."""
        return self._call(self._async.latest_step)

    def best_step(self, metric: str, mode: str = "min") -> int | None:
        """The committed step with the best ``metric`` (see AsyncCheckpointManager)."""
        return self._call(self._async.best_step, metric, mode)

    def load(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        strict: bool = True,
        keys: str | Iterable[str] | None = None,
        atomic: bool = True,
    ) -> Any:
        """The state saved at ``step`` (latest when None); see AsyncCheckpointManager.load."""
        return self._call(
            self._async.load, step, into=into, strict=strict, keys=keys, atomic=atomic
        )
