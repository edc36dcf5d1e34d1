"""``open()`` and ``aclose()`` inside the caller's cancel scopes: the cleanup idioms of asyncio
and trio code (a shield, ``fail_after``, ``move_on_after``) work, and leave the caller's task
as it was."""

from __future__ import annotations

import os

import anyio
import pytest
import torch

from aiockpt import AsyncCheckpointManager

pytestmark = pytest.mark.anyio

BACKENDS = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def still_runs() -> None:
    """The caller's task is not cancelled: it sleeps and returns."""
    with anyio.fail_after(30):
        await anyio.sleep(0.001)
        await anyio.sleep(0)


@BACKENDS
async def test_aclose_in_a_shield(root, anyio_backend):
    state = {"w": torch.arange(8.0)}
    mgr = AsyncCheckpointManager(root)
    await mgr.open()
    pid = mgr.daemon_pid
    assert pid is not None
    handle = await mgr.save(1, state)
    with anyio.CancelScope(shield=True):
        await mgr.aclose()
    assert handle.done()
    assert (await handle).step == 1
    assert gone(pid)
    await still_runs()
    async with AsyncCheckpointManager(root) as again:
        assert await again.steps() == [1]


@BACKENDS
async def test_open_and_aclose_in_scopes_of_their_own(root, anyio_backend):
    mgr = AsyncCheckpointManager(root)
    with anyio.fail_after(60):
        await mgr.open()
    with anyio.move_on_after(60):
        await (await mgr.save(1, {"w": torch.ones(4)}))
    with anyio.move_on_after(60, shield=True) as scope:
        await mgr.aclose()
    assert not scope.cancelled_caught
    with anyio.fail_after(60):
        await mgr.aclose()  # a second close does nothing
    await still_runs()


@BACKENDS
async def test_aclose_in_a_shield_of_a_cancelled_task(root, anyio_backend):
    """The usual cleanup: the caller is cancelled, and closes in a shielded ``finally``."""
    with anyio.CancelScope() as outer:
        mgr = AsyncCheckpointManager(root)
        await mgr.open()
        pid = mgr.daemon_pid
        await mgr.save(1, {"w": torch.ones(4)})
        try:
            outer.cancel()
            await anyio.sleep(30)
        finally:
            with anyio.CancelScope(shield=True):
                await mgr.aclose()
    assert outer.cancelled_caught
    assert pid is not None
    assert gone(pid)
    await still_runs()
    async with AsyncCheckpointManager(root, read_only=True) as again:
        assert await again.steps() == [1]


@BACKENDS
async def test_aclose_under_an_expired_deadline_still_closes(root, anyio_backend):
    mgr = AsyncCheckpointManager(root)
    await mgr.open()
    pid = mgr.daemon_pid
    await mgr.save(1, {"w": torch.ones(4)})
    with anyio.move_on_after(0) as scope:
        await anyio.sleep(1)  # the deadline has passed
        await mgr.aclose()
    assert scope.cancelled_caught
    await mgr.aclose()  # (cancelled before it ran above)
    assert pid is not None
    assert gone(pid)
    await still_runs()
    async with AsyncCheckpointManager(root, read_only=True) as again:
        assert await again.steps() == [1]


@BACKENDS
async def test_a_manager_opened_by_one_task_is_closed_by_another(root, anyio_backend):
    mgr = AsyncCheckpointManager(root)
    async with anyio.create_task_group() as tg:
        tg.start_soon(mgr.open)
    await (await mgr.save(1, {"w": torch.ones(4)}))
    async with anyio.create_task_group() as tg:
        tg.start_soon(mgr.aclose)
    await still_runs()
