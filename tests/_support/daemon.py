"""The daemon's code run in the test's own process, for a test to drive it step by step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from multiprocessing import Pipe

from aiockpt._core.protocol import Hello
from aiockpt._daemon.server import Daemon, PipeEnd
from aiockpt.retention import RetentionPolicy
from aiockpt.storage import LocalStorage


@contextlib.contextmanager
def daemon_in_process(
    root: str, policy: RetentionPolicy, storage: LocalStorage
) -> Iterator[Daemon]:
    """The daemon's code run in this process over ``storage``, for a test to drive it."""
    parent, child = Pipe()
    hello = Hello(url=root, storage_options={}, retention=policy)
    daemon = Daemon(PipeEnd(child), hello, storage=storage)
    try:
        yield daemon
    finally:
        daemon.close()
        parent.close()
        child.close()
