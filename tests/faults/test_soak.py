"""Many saves back to back: nothing accumulates in the trainer or in shared memory."""

from __future__ import annotations

import json
import os

import psutil
import pytest
import torch
from _support.roots import shm_segments

from aiockpt import AsyncCheckpointManager

from ._helpers import step_dir

pytestmark = pytest.mark.anyio

SAVES = 200


async def test_two_hundred_back_to_back_saves(root):
    """200 saves of a small state with max_pending=2, each started as soon as the last one
    was staged: all commit, in step order; the trainer's RSS grows under 5% from save 20 to
    save 200; the number of shared-memory segments stays where it was at save 20."""
    proc = psutil.Process()
    state = {"w": torch.randn(4096), "b": torch.zeros(64, dtype=torch.int32), "step": 0}
    handles = []
    async with AsyncCheckpointManager(root, max_pending=2) as mgr:
        for step in range(SAVES):
            state["step"] = step
            state["b"].fill_(step)
            handles.append(await mgr.save(step, state, metrics={"loss": 1.0 / (step + 1)}))
            if step == 20:
                rss_20 = proc.memory_info().rss
                shm_20 = len(shm_segments(os.getpid()))
        rss_200 = proc.memory_info().rss
        shm_200 = len(shm_segments(os.getpid()))
        infos = [await h for h in handles]
        assert [i.step for i in infos] == list(range(SAVES))
        assert await mgr.steps() == list(range(SAVES))
        last = await mgr.load(SAVES - 1)
        assert last["step"] == SAVES - 1
        assert torch.equal(last["b"], torch.full((64,), SAVES - 1, dtype=torch.int32))
    assert rss_200 < rss_20 * 1.05, (rss_20, rss_200)
    assert shm_200 <= shm_20 <= 2
    created = []
    for step in range(SAVES):
        with open(os.path.join(step_dir(root, step), "manifest.json")) as f:
            created.append(json.load(f)["created_at"])
    assert created == sorted(created)  # committed one after another, in step order
