"""Shared memory left behind by a job killed whole is swept when a manager opens."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aiockpt import AsyncCheckpointManager
from aiockpt._core.shm import Segment, sweep_orphans, unlink


def make_segment(pid: int, tag: str) -> str:
    name = f"/aiockpt-{pid}-slab-{tag}"
    Segment(name, 8192, create=True).close()
    return name


@pytest.mark.anyio
async def test_open_sweeps_segments_of_dead_processes_only(root):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    orphans = [make_segment(dead.pid, f"sweeptest{i}") for i in range(2)]
    kept = make_segment(live.pid, "sweeptest")
    events = []
    try:
        async with AsyncCheckpointManager(root, event_handlers=[events.append]):
            pass
        left = set(os.listdir("/dev/shm"))
        assert [n for n in orphans if n[1:] in left] == []
        assert kept[1:] in left  # a live process's segment is never touched
        swept = [e for e in events if e.name == "shm.swept"]
        assert len(swept) == 1
        assert swept[0].nbytes is not None
        assert swept[0].nbytes >= 2 * 8192
    finally:
        live.kill()
        live.wait()
        for name in [*orphans, kept]:
            unlink(name)


def test_the_sweep_can_be_turned_off(monkeypatch):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = make_segment(dead.pid, "sweepoff")
    try:
        monkeypatch.setenv("AIOCKPT_NO_SHM_SWEEP", "1")
        assert sweep_orphans() == {}
        assert orphan[1:] in os.listdir("/dev/shm")
        monkeypatch.delenv("AIOCKPT_NO_SHM_SWEEP")
        assert orphan in sweep_orphans()
    finally:
        unlink(orphan)
