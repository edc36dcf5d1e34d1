"""CheckpointManager: the same manager for training loops that are not async.

It runs an :class:`~aiockpt.AsyncCheckpointManager` on an event loop of its own, in a thread
(anyio's blocking portal), and blocks the caller only for what the async API awaits: ``save``
returns once the snapshot is taken, and the write and commit go on in the background while
training continues, exactly as with the async manager.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any, Concatenate, ParamSpec

import anyio
from anyio.from_thread import BlockingPortal

from .._core.protocol import CheckpointInfo
from ..errors import ManagerClosedError
from ..events import logger
from .ledger import SaveHandle
from .manager import AsyncCheckpointManager

__all__ = ["CheckpointManager", "SyncSaveHandle"]

P = ParamSpec("P")


def same_options_as(
    of: Callable[Concatenate[Any, P], None],
) -> Callable[[Callable[..., None]], Callable[Concatenate[Any, P], None]]:
    """Give the decorated ``__init__`` the parameters of ``of`` (the async manager's), for
    type checkers and ``help()``: the options are declared once, where they are checked."""

    def give(init: Callable[..., None]) -> Callable[Concatenate[Any, P], None]:
        init.__signature__ = inspect.signature(of)  # type: ignore[attr-defined]
        return init

    return give


#: Seconds a manager left open waits at interpreter exit for its saves in flight to commit
#: (``close_timeout`` when set); what is still pending then is left to the daemon.
EXIT_TIMEOUT = 5.0


class _LoopThread:
    """An event loop in a daemon thread, serving a blocking portal.

    A daemon thread never holds up the interpreter's exit, and nothing here calls into the
    loop from a finalizer: anyio's ``start_blocking_portal`` stops its loop when its context
    manager is finalized, which for a manager never closed happens at interpreter teardown,
    once daemon threads can no longer run, and so waited forever.
    """

    def __init__(self) -> None:
        ready: Future[BlockingPortal] = Future()

        async def serve() -> None:
            async with BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        def run() -> None:
            try:
                anyio.run(serve, backend="asyncio")
            except BaseException as e:
                if not ready.done():
                    ready.set_exception(e)

        self._thread = threading.Thread(target=run, name="aiockpt-manager", daemon=True)
        self._thread.start()
        self.portal = ready.result()

    def stop(self, *, cancel: bool = False) -> None:
        """End the loop (cancelling what still runs in it with ``cancel``) and its thread."""
        with contextlib.suppress(RuntimeError):  # stopped already
            self.portal.call(self.portal.stop, cancel)
        self._thread.join()


#: Sync managers open now, closed at interpreter exit if their owner did not.
_OPEN: set[CheckpointManager] = set()


@atexit.register
def _close_at_exit() -> None:
    """Close every manager left open, within a bounded time each. (``atexit`` handlers run
    while the managers' loop threads still do; later, during teardown, they no longer run.)"""
    for mgr in list(_OPEN):
        with contextlib.suppress(Exception):
            mgr._close_at_exit()


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

    A manager never closed does not keep the interpreter alive: at exit it waits for its saves
    in flight (``close_timeout``, or 5 s), then closes, or logs a warning naming the steps it
    leaves to the daemon, which commits what was staged once this process is gone.
    """

    @same_options_as(AsyncCheckpointManager.__init__)
    def __init__(self, root: str | os.PathLike[str] | None = None, **options: Any) -> None:
        if "on_sigterm" in options:
            raise TypeError(
                "CheckpointManager does not take on_sigterm: a signal handler must be "
                "installed by the main thread, and the manager's loop runs in another (use "
                "AsyncCheckpointManager for on_sigterm)"
            )
        self._options = dict(options)
        if "event_handlers" in options:
            self._options["event_handlers"] = list(options["event_handlers"])
        self._root = root
        # Built here too, so bad arguments fail at once, as with the async manager; the one
        # that runs is built on the manager's loop when it opens.
        self._async = AsyncCheckpointManager(root, **self._options)
        self._loop: _LoopThread | None = None
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
        self._loop = _LoopThread()
        self._portal = portal = self._loop.portal
        try:
            self._async = portal.call(self._build)
            # One task enters and exits the manager (its task group must), whatever task
            # each later call runs in.
            self._context = portal.wrap_async_context_manager(self._async)
            self._context.__enter__()
        except BaseException:
            self._state = "closed"
            self._loop.stop(cancel=True)
            raise
        self._state = "open"
        _OPEN.add(self)

    async def _build(self) -> AsyncCheckpointManager:
        return AsyncCheckpointManager(self._root, **self._options)

    def close(self) -> None:
        """Wait for pending saves, stop the daemon, and end the event loop thread."""
        if self._state != "open":
            self._state = "closed"
            return
        self._state = "closed"
        _OPEN.discard(self)
        assert self._context is not None
        assert self._loop is not None
        try:
            self._context.__exit__(None, None, None)
        finally:
            self._loop.stop()

    def _close_at_exit(self) -> None:
        """At interpreter exit, for a manager nobody closed: wait a bounded time for the saves
        in flight, then close; or, if some are still pending, warn and leave them to the
        daemon, which finishes what was staged once this process is gone."""
        if self._state != "open" or self._portal is None:
            return
        timeout = self._options.get("close_timeout") or EXIT_TIMEOUT
        left = self._portal.call(_settle, self._async, timeout)
        if not left:
            self.close()
            return
        _OPEN.discard(self)
        self._state = "closed"
        logger.warning(
            "the CheckpointManager of %s was never closed; at exit, the saves of steps %s had "
            "not committed after %.1f s and are left to its daemon (they may still commit). "
            "Close the manager, or use `with`, to wait for them",
            self.url,
            left,
            timeout,
        )

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

    @property
    def root_id(self) -> str | None:
        """The root's identity (see AsyncCheckpointManager.root_id)."""
        return self._async.root_id

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> SyncSaveHandle:
        """Snapshot ``state`` and start writing it; returns once the state may be mutated.
        A committed ``step`` is refused unless ``overwrite``, which replaces it atomically."""
        handle = self._call(
            self._async.save, step, state, metrics=metrics, metadata=metadata, overwrite=overwrite
        )
        assert self._portal is not None
        return SyncSaveHandle(handle, self._portal)

    def delete(self, step: int, *, allow_latest: bool = False) -> None:
        """Delete the committed ``step`` (see AsyncCheckpointManager.delete)."""
        self._call(self._async.delete, step, allow_latest=allow_latest)

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

    def load_safetensors(
        self, source: Any, into: Any = None, *, rename: Any = None, dtype: Any = None
    ) -> Any:
        """Hugging Face safetensors weights; see AsyncCheckpointManager.load_safetensors."""
        return self._call(self._async.load_safetensors, source, into, rename=rename, dtype=dtype)


async def _settle(mgr: AsyncCheckpointManager, timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for ``mgr``'s saves in flight; the steps still pending."""
    with anyio.move_on_after(timeout):
        await mgr._ledger.settle()
    return sorted(h.step for h in mgr._ledger.pending.values())
