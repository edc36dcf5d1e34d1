"""The leak check every test runs under: nothing a test started may outlive it.

A conftest turns it on for its tests with ``from _support.leaks import no_leaks``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import psutil
import pytest

from .roots import SHM, live_daemons, shm_segments


def _segments() -> set[str]:
    return shm_segments()


def leaked_segments(before: set[str]) -> set[str]:
    """Segments made since ``before`` by this process, a descendant, or a process that is gone
    (a daemon of this test that died): another live process's aiockpt, elsewhere on the
    machine, is not this test's leak."""
    family = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    leaked = set()
    for name in _segments() - before:
        pid_text = name.split("-")[1]
        if not pid_text.isdigit():
            continue
        pid = int(pid_text)
        if pid in family or not psutil.pid_exists(pid):
            leaked.add(name)
    return leaked


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """After every test: no shared-memory segment and no daemon process left behind."""
    before = _segments()
    yield
    deadline = time.monotonic() + 10
    while True:
        leaked = leaked_segments(before)
        daemons = live_daemons()
        if not leaked and not daemons:
            return
        if time.monotonic() > deadline:
            for p in daemons:
                p.kill()
            for name in leaked:
                os.unlink(os.path.join(SHM, name))
            pytest.fail(f"leaked shared memory {sorted(leaked)} / daemon processes {daemons}")
        time.sleep(0.05)
