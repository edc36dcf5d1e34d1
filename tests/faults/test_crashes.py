"""Process deaths: the daemon killed mid-write, the trainer killed after or during a save, and
SIGTERM (preemption) with on_sigterm="flush". Every committed checkpoint must survive each."""

from __future__ import annotations

import os
import signal
import threading

import anyio
import pytest
import torch
from _support.roots import live_daemons, shm_segments

from aiockpt import AsyncCheckpointManager
from aiockpt.errors import DaemonDiedError

from ._helpers import (
    Trainer,
    alive,
    committed,
    reap_daemon,
    step_dir,
    verify_checkpoint,
    wait_until,
)

pytestmark = pytest.mark.anyio


async def test_daemon_sigkilled_while_writing(root):
    """The writing save and the one queued behind it fail with DaemonDiedError (none hangs);
    the next save starts a new daemon and commits; earlier checkpoints load and verify; the
    half-written step directory is not listed and is removed at the next start-up."""
    big = {"t": torch.randn(48 << 20)}  # 192 MiB: still being written when the kill lands
    async with AsyncCheckpointManager(root, max_pending=2) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, {"small": torch.arange(10) * step, "step": step}))
        first = mgr.daemon_pid
        # Both saves are staged before the daemon may start on them, so the kill lands while
        # step 3 is written and step 4 waits behind it, however fast staging or writing is.
        os.kill(first, signal.SIGSTOP)
        writing = await mgr.save(3, big)
        queued = await mgr.save(4, big)
        os.kill(first, signal.SIGCONT)
        await anyio.to_thread.run_sync(
            wait_until,
            lambda: os.path.exists(step_dir(root, 3)),
            30,
            "the daemon starts writing step 3",
        )
        os.kill(first, signal.SIGKILL)
        with anyio.fail_after(30):  # a hang here is the failure this test exists for
            for handle in (writing, queued):
                with pytest.raises(DaemonDiedError) as exc:
                    await handle
                assert exc.value.exit_code == -signal.SIGKILL
        assert await mgr.steps() == [1, 2]
        info = await (await mgr.save(5, {"small": torch.arange(5)}))
        assert info.step == 5
        assert mgr.daemon_pid != first
        assert await mgr.steps() == [1, 2, 5]
        for step in (1, 2):
            out = await mgr.load(step)
            assert torch.equal(out["small"], torch.arange(10) * step)
            assert out["step"] == step
    for step in (1, 2, 5):
        verify_checkpoint(root, step)
    async with AsyncCheckpointManager(root) as mgr:
        assert await mgr.steps() == [1, 2, 5]
    assert not os.path.exists(step_dir(root, 3))  # the partial, collected at start-up
    assert not os.path.exists(step_dir(root, 4))


async def test_trainer_sigkilled_after_save_returned(root):
    """Saves staged when the trainer dies still commit: within 10 s the daemon has committed
    them, unlinked the trainer's shared memory and exited; a new manager lists and loads them."""
    trainer = Trainer("staged", root)
    try:
        (daemon_pid,) = map(int, trainer.expect("DAEMON"))
        trainer.expect("STAGED")
        trainer.kill(signal.SIGKILL)
        assert trainer.wait() == -signal.SIGKILL
    finally:
        trainer.close()
    await anyio.to_thread.run_sync(reap_daemon, daemon_pid, 10)
    assert shm_segments(trainer.pid) == set()
    assert committed(root) == [1, 2, 3]
    async with AsyncCheckpointManager(root) as mgr:
        assert await mgr.steps() == [1, 2, 3]
        for step in (2, 3):
            out = await mgr.load(step)
            assert out["w"].shape == (32 << 20,)
            assert bool((out["w"] == step).all())
            del out
    for step in (1, 2, 3):
        verify_checkpoint(root, step)


def _kill_mid_staging(root: str) -> set[str]:
    """Run a trainer, SIGKILL it inside the copy of save(2); return the segments it left."""
    trainer = Trainer("staging", root)
    try:
        (daemon_pid,) = map(int, trainer.expect("DAEMON"))
        trainer.expect("COPYING")
        trainer.kill(signal.SIGKILL)
        assert trainer.wait() == -signal.SIGKILL
    finally:
        trainer.close()
    reap_daemon(daemon_pid, 10)
    leaked = shm_segments(trainer.pid)
    for name in leaked:  # unlink here, so a leak is reported once, by the assertion that wants it
        os.unlink(os.path.join("/dev/shm", name))
    return leaked


async def test_trainer_sigkilled_mid_staging(root):
    """Killed while copying the state into shared memory: the save never reached the daemon,
    so no manifest and no step directory exist for it; the daemon exits; the earlier
    checkpoint is intact and the next manager starts cleanly."""
    await anyio.to_thread.run_sync(_kill_mid_staging, root)
    assert committed(root) == [1]
    assert not os.path.exists(os.path.join(step_dir(root, 2), "manifest.json"))
    async with AsyncCheckpointManager(root) as mgr:
        assert await mgr.steps() == [1]
        assert torch.equal((await mgr.load(1))["w"], torch.arange(10))
    assert not os.path.exists(step_dir(root, 2))


async def test_trainer_sigkilled_mid_staging_leaves_no_shared_memory(root):
    """The slab being filled when the trainer died is unlinked (by the daemon, the only
    process of the run left); otherwise every preemption leaks a state-sized segment of RAM."""
    leaked = await anyio.to_thread.run_sync(_kill_mid_staging, root)
    assert leaked == set()


async def test_partial_from_a_crash_is_collected_at_start_up(root):
    """A step directory left without a manifest (a crash mid-write) is never listed or loaded.
    Below the newest commit it is dead and the next manager removes it when it starts; above
    it, it may be a save an orphaned daemon is still finishing, so it stays until a newer step
    commits."""
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"w": torch.arange(3)}))
        await (await mgr.save(3, {"w": torch.arange(3)}))
    for step in (2, 9):
        os.makedirs(step_dir(root, step))
        with open(os.path.join(step_dir(root, step), "shard_r00000.safetensors"), "wb") as f:
            f.write(b"\0" * 5000)  # a torn shard
    async with AsyncCheckpointManager(root) as mgr:
        assert not os.path.exists(step_dir(root, 2))
        assert os.path.exists(step_dir(root, 9))
        assert await mgr.steps() == [1, 3]
        assert torch.equal((await mgr.load())["w"], torch.arange(3))
        await (await mgr.save(10, {"w": torch.arange(4)}))
    async with AsyncCheckpointManager(root) as mgr:
        assert not os.path.exists(step_dir(root, 9))
        assert await mgr.steps() == [1, 3, 10]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
async def test_sigterm_flushes_staged_saves(root, backend):
    """Preemption: with on_sigterm="flush", SIGTERM makes the trainer commit what is staged and
    stop its daemon before it exits, so a scheduler that SIGKILLs the whole process group the
    moment the trainer exits loses nothing. The trainer still dies by SIGTERM."""
    trainer = Trainer("sigterm", root, backend, new_session=True)
    try:
        (daemon_pid,) = map(int, trainer.expect("DAEMON"))
        trainer.expect("STAGED")
        trainer.kill(signal.SIGTERM)
        code = trainer.wait()
        # What a scheduler does once the main process is gone: kill everything left.
        survivors = alive(daemon_pid)
        if survivors:
            os.kill(daemon_pid, signal.SIGKILL)
    finally:
        trainer.close()
    assert code == -signal.SIGTERM
    assert "NOT KILLED" not in trainer.lines
    assert not survivors, "the daemon was still running when the trainer exited"
    assert committed(root) == [1, 2]
    for step in (1, 2):
        verify_checkpoint(root, step)
    assert shm_segments(trainer.pid) == set()


async def test_sigterm_handler_is_restored_on_close(root):
    """The previous SIGTERM handler is back once the manager closes."""

    def mine(signum, frame):  # pragma: no cover - never delivered
        raise AssertionError("not expected")

    before = signal.signal(signal.SIGTERM, mine)
    try:
        async with AsyncCheckpointManager(root, on_sigterm="flush") as mgr:
            assert signal.getsignal(signal.SIGTERM) is not mine
            await (await mgr.save(1, {"w": torch.zeros(2)}))
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sigterm_flush_outside_the_main_thread_is_refused(root):
    """Signal handlers can only be set from the main thread: say so at open."""
    errors: list[BaseException] = []

    async def open_it() -> None:
        async with AsyncCheckpointManager(root, on_sigterm="flush"):
            pass

    def run() -> None:
        try:
            anyio.run(open_it)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert len(errors) == 1
    assert isinstance(errors[0], RuntimeError)
    assert "main thread" in str(errors[0])
    assert live_daemons() == []


def test_on_sigterm_value_is_checked(root):
    with pytest.raises(ValueError, match="on_sigterm"):
        AsyncCheckpointManager(root, on_sigterm="ignore")
