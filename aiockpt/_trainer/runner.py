"""The manager's background tasks, in a task group of its own.

A daemon's reader, a load's warm-up and the SIGTERM watch run for as long as the manager is
open, so they cannot live in a task group of the caller's task: ``open()`` would enter it and
``aclose()`` exit it, and a caller that closes inside a cancel scope of its own (a shield,
``fail_after``, ``move_on_after``: the usual cleanup) would exit scopes out of order. The task
group is hosted by a task of the manager's own instead, started on the running event loop
(an asyncio task, a trio system task) by :meth:`TaskRunner.start` and ended by
:meth:`TaskRunner.stop`; the caller's task enters no scope that outlives a call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc

from ..events import logger


class TaskRunner:
    """A task group hosted by a task of its own, for the tasks that outlive a call."""

    def __init__(self) -> None:
        self._tg: anyio.abc.TaskGroup | None = None
        self._ready = anyio.Event()
        self._done = anyio.Event()
        self._error: BaseException | None = None
        self._started = False
        self._task: Any = None  # (asyncio keeps only a weak reference to its tasks)

    @property
    def tg(self) -> anyio.abc.TaskGroup:
        """The task group, while the runner runs."""
        if self._tg is None:
            raise RuntimeError("the manager's task runner is not running")
        return self._tg

    async def start(self) -> None:
        """Start the host task on the running event loop and wait until its group is open."""
        self._started = True
        _spawn(self._host, self)
        with anyio.CancelScope(shield=True):  # (the wait ends at the host's first step)
            await self._ready.wait()

    async def _host(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._ready.set()
                await anyio.sleep_forever()
        except BaseException as e:  # kept for stop(), a cancellation too
            self._error = e
        finally:
            self._tg = None
            self._ready.set()
            self._done.set()

    async def stop(self) -> None:
        """End every task of the group and wait for the host; raise what failed a task.
        Shielded: it finishes whatever cancel scope the caller is in."""
        with anyio.CancelScope(shield=True):
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
            if self._started:
                await self._done.wait()
        self._task = None
        error, self._error = self._error, None
        if error is not None and not isinstance(error, anyio.get_cancelled_exc_class()):
            logger.error("a background task of the manager failed", exc_info=error)
            raise error


def _spawn(host: Callable[[], Awaitable[None]], runner: TaskRunner) -> None:
    """Run ``host`` as a task of the running loop, outside every task and scope of the caller."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: trio, anyio's other backend
        import trio

        trio.lowlevel.spawn_system_task(host, name="aiockpt-manager")
        return
    runner._task = loop.create_task(host(), name="aiockpt-manager")  # type: ignore[arg-type]
