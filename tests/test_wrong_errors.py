"""Errors say what happened: a step deleted under a load is not found, a manifest that is
not a file is corruption."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt
from aiockpt.errors import CheckpointNotFoundError, CorruptCheckpointError

pytestmark = pytest.mark.anyio


async def test_a_step_deleted_while_it_is_loaded_is_not_found(tmp_path, test_storages):
    root, vanish = str(tmp_path / "run"), tmp_path / "vanish"
    url = f"vanishing://{root}"
    async with AsyncCheckpointManager(url, storage_options={"vanish": str(vanish)}) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, {"w": torch.full((1000,), float(step))}))
        vanish.touch()  # step 1 is deleted as its shard is first read
        with pytest.raises(CheckpointNotFoundError, match="deleted .* while it was being loaded"):
            await mgr.load(1)
        assert await mgr.steps() == [2]
        assert torch.equal((await mgr.load())["w"], torch.full((1000,), 2.0))


async def test_a_manifest_that_is_a_directory_is_corrupt(root):
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"w": torch.ones(3)}))
    manifest = Path(root) / fmt.step_dirname(1) / fmt.MANIFEST
    os.unlink(manifest)
    manifest.mkdir()
    async with AsyncCheckpointManager(root, read_only=True) as mgr:
        with pytest.raises(CorruptCheckpointError, match="directory"):
            await mgr.load(1)
