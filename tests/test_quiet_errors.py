"""An error raised to the caller is the caller's report: the log says it in one line, without
the traceback, which the ``*.exception`` event keeps."""

from __future__ import annotations

import logging

import pytest
import torch
from _support.roots import flip_byte, shard_path

from aiockpt import AsyncCheckpointManager, Event
from aiockpt.errors import CorruptCheckpointError

pytestmark = pytest.mark.anyio


async def test_a_load_error_the_caller_catches_is_not_logged_with_its_traceback(
    root: str, caplog: pytest.LogCaptureFixture
) -> None:
    events: list[Event] = []
    async with AsyncCheckpointManager(root, event_handlers=[events.append]) as mgr:
        await (await mgr.save(1, {"w": torch.arange(1000.0)}))
        flip_byte(shard_path(root, 1), 5000)
        with caplog.at_level(logging.INFO, logger="aiockpt"), pytest.raises(CorruptCheckpointError):
            # into=: a load the daemon reads (a plain load() of a local root is read, and
            # its error raised, in this process; tests/test_direct_loads.py)
            await mgr.load(1, into={"w": torch.zeros(1000)})
    logged = [r for r in caplog.records if r.name == "aiockpt" and r.levelno >= logging.INFO]
    (line,) = [r for r in logged if r.getMessage().startswith("load.exception")]
    assert line.levelno == logging.ERROR
    assert "Traceback" not in line.getMessage()
    assert "crc32c" in line.getMessage()
    assert len(line.getMessage().splitlines()) == 1
    assert not any(r.exc_info for r in logged)
    # The event keeps the whole record, the daemon's traceback included.
    (event,) = [e for e in events if e.name == "load.exception"]
    assert event.error is not None
    assert "Traceback" in event.error["traceback"]
    assert "Raised in the daemon" in event.error["traceback"]
