"""Storage that fails with a real OS error: the save fails with StorageError carrying the
errno, retention deletes nothing, no partial is left, and the manager keeps working."""

from __future__ import annotations

import errno
import json
import os
import resource

import pytest
import torch

from aiockpt import AsyncCheckpointManager
from aiockpt.errors import StorageError
from aiockpt.retention import LatestN

from ._helpers import Trainer, committed, step_dir, verify_checkpoint

pytestmark = pytest.mark.anyio

LIMIT = 1 << 20


async def open_with_file_size_limit(url: str, **kwargs) -> AsyncCheckpointManager:
    """Open a manager whose daemon inherits RLIMIT_FSIZE = 1 MiB (ours is restored at once).

    CPython ignores SIGXFSZ, so a write past the limit fails with EFBIG instead of killing
    the daemon: a real full-file error from the kernel, with no special filesystem needed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
    try:
        mgr = AsyncCheckpointManager(url, **kwargs)
        await mgr.open()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return mgr


@pytest.mark.parametrize("scheme", ["path", "file-url"])
async def test_file_size_limit_fails_the_save_with_efbig(tmp_path, scheme):
    root = str(tmp_path / "run")
    url = root if scheme == "path" else f"file://{root}"
    mgr = await open_with_file_size_limit(url, retention=LatestN(1))
    try:
        await (await mgr.save(1, {"w": torch.arange(10)}))
        await (await mgr.save(2, {"w": torch.arange(20)}))
        assert await mgr.steps() == [2]  # retention works while writes fit
        big = {"w": torch.randn(LIMIT)}  # 4 MiB: past the limit
        handle = await mgr.save(3, big)
        with pytest.raises(StorageError) as exc:
            await handle
        assert exc.value.errno == errno.EFBIG
        assert isinstance(exc.value, OSError)
        assert "step_000000000003" in str(exc.value)
        # The failed save displaced nothing and left no partial behind.
        assert await mgr.steps() == [2]
        assert not os.path.exists(step_dir(root, 3))
        assert torch.equal((await mgr.load(2))["w"], torch.arange(20))
        # The manager (and its daemon) keep working, and retention resumes with the next commit.
        daemon = mgr.daemon_pid
        await (await mgr.save(4, {"w": torch.arange(40)}))
        assert mgr.daemon_pid == daemon
        assert await mgr.steps() == [4]
        with pytest.raises(StorageError):  # a second failure is reported the same way
            await (await mgr.save(5, big))
        assert await mgr.steps() == [4]
    finally:
        await mgr.aclose()
    verify_checkpoint(root, 4)


async def test_read_only_root_and_step_directory(root):
    """A read-only root (mkdir of the step directory fails) and a read-only step directory
    (creating the shard fails) both give StorageError(EACCES) naming the path. Runs in its own
    trainer process so that, when run as root, the daemon can be started without the
    capability that lets root ignore permission bits."""
    trainer = Trainer("readonly", root)
    try:
        text = " ".join(trainer.expect("RESULT", timeout=120))
        assert trainer.wait() == 0
    finally:
        trainer.close()
    result = json.loads(text)
    eacces = result["EACCES"]
    assert result["root"][0] == eacces
    assert "step_000000000002" in result["root"][1]
    assert result["after_root"] == [1]  # retention (LatestN(1)) deleted nothing
    assert result["step_dir"][0] == eacces
    assert "step_000000000003/shard_r00000." in result["step_dir"][1]
    assert result["after_step_dir"] == [1]
    assert result["partial_left"] is False  # the failed save's directory is cleaned up
    assert result["after_recovery"] == [4]  # works again; retention then drops step 1
    assert result["loaded"] is True
    assert committed(root) == [4]
    verify_checkpoint(root, 4)
