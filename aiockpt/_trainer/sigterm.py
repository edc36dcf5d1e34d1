"""``on_sigterm="flush"``: commit what is staged when the process is told to stop."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc


def require_main_thread() -> None:
    """Refuse to flush on SIGTERM from a loop outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "on_sigterm='flush' needs the event loop in the main thread: Python sets signal "
            "handlers only there"
        )


class SigtermFlush:
    """On SIGTERM, run ``flush``, then hand the signal to the handler the process had
    before (by default: terminate)."""

    def __init__(self, flush: Callable[[], Awaitable[None]]) -> None:
        self._flush = flush
        self._previous: Any = None

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Watch for SIGTERM in a task of ``tg``, from now on."""
        self._previous = signal.getsignal(signal.SIGTERM)
        await tg.start(self._watch)

    async def _watch(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            task_status.started()
            async for _ in signals:
                break
            with anyio.CancelScope(shield=True):
                await self._flush()
        # The receiver is closed (asyncio leaves SIG_DFL behind): put the old handler back.
        self.restore()
        os.kill(os.getpid(), signal.SIGTERM)

    def restore(self) -> None:
        """Put back the SIGTERM handler the process had before ``start``."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
