"""The suite's own leak check counts only this test run's shared memory."""

from __future__ import annotations

import os
import subprocess

from _support.leaks import _segments, leaked_segments

from aiockpt._core.shm import Segment, unlink


def test_another_live_process_segments_are_not_a_leak_but_ours_are():
    # A process that is not our descendant: the shell exits, its sleep is reparented.
    out = subprocess.run(
        ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True
    )
    stranger = int(out.stdout)
    before = _segments()
    theirs = f"/aiockpt-{stranger}-slab-leakcheck"
    ours = f"/aiockpt-{os.getpid()}-slab-leakcheck"
    try:
        for name in (theirs, ours):
            Segment(name, 4096, create=True).close()
        assert leaked_segments(before) == {ours[1:]}
    finally:
        for name in (theirs, ours):
            unlink(name)
        os.kill(stranger, 9)
