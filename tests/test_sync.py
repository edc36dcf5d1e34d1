"""The blocking CheckpointManager, and async handles used from the wrong event loop."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import textwrap

import anyio
import pytest
import torch

from aiockpt import AsyncCheckpointManager, CheckpointManager, LatestN, SyncSaveHandle
from aiockpt.errors import ManagerClosedError, StepExistsError


def test_a_sync_loop_saves_in_the_background_and_resumes(root):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    events = []
    with CheckpointManager(root, retention=LatestN(2), event_handlers=[events.append]) as mgr:
        handles = []
        for step in range(1, 4):
            loss = model(torch.randn(2, 8)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            handle = mgr.save(step, {"model": model, "optim": opt, "step": step})
            assert isinstance(handle, SyncSaveHandle)
            handles.append(handle)
        infos = [h.result(timeout=60) for h in handles]
        assert [i.step for i in infos] == [1, 2, 3]
        assert all(h.done() for h in handles)
        assert mgr.steps() == [2, 3]
        assert mgr.latest_step() == 3
        assert mgr.daemon_pid is not None
        with pytest.raises(StepExistsError):
            mgr.save(3, {"x": torch.zeros(1)})
        model2 = torch.nn.Linear(8, 4)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
        state = {"model": model2, "optim": opt2, "step": 0}
        assert mgr.load(into=state) is state
    assert state["step"] == 3
    assert torch.equal(model2.weight, model.weight)
    assert opt2.param_groups[0]["lr"] == 0.01
    assert {"save.end", "load.end"} <= {e.name for e in events}
    with pytest.raises(ManagerClosedError):
        mgr.steps()


def test_a_sync_handle_is_done_without_being_waited_on(root):
    with CheckpointManager(root) as mgr:
        handle = mgr.save(1, {"w": torch.ones(1000)})
        mgr.wait()  # returns once every pending save ended
        assert handle.done()
        assert repr(handle) == "<SyncSaveHandle step=1 committed>"


def test_sync_manager_refuses_bad_arguments_at_once_and_use_before_open(root):
    with pytest.raises(ValueError, match="max_pending"):
        CheckpointManager(root, max_pending=0)
    mgr = CheckpointManager(root)
    with pytest.raises(ManagerClosedError, match="not open"):
        mgr.save(1, {})
    mgr.close()  # closing one that never opened is fine


def test_an_async_handle_awaited_from_another_event_loop_raises_instead_of_hanging(root):
    async def main():
        async with AsyncCheckpointManager(root) as mgr:
            handle = await mgr.save(1, {"w": torch.ones(4)})

            async def wait_elsewhere():
                await handle

            async def use_elsewhere():
                await mgr.steps()

            # Another thread running its own loop, as asyncio.run() per call does.
            with pytest.raises(RuntimeError, match="a SaveHandle is bound to the event loop"):
                await anyio.to_thread.run_sync(asyncio.run, wait_elsewhere())
            with pytest.raises(RuntimeError, match="the manager is bound to the event loop"):
                await anyio.to_thread.run_sync(asyncio.run, use_elsewhere())
            assert (await handle).step == 1

    asyncio.run(main())


TRAINER = textwrap.dedent(
    """
    import random, sys
    import numpy as np, torch
    from aiockpt import CheckpointManager

    root, stop = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0); np.random.seed(0); random.seed(0)
    emb = torch.nn.Embedding(16, 8)
    head = torch.nn.Linear(8, 16, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.Sequential(emb, torch.nn.Dropout(0.1), head)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    stats = np.zeros(3)  # a numpy array the loop updates
    def rng():
        return {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }

    state = {"model": model, "optim": opt, "sched": sched, "step": 0, "stats": stats, "rng": rng()}
    losses = []
    with CheckpointManager(root) as mgr:
        if mgr.latest_step() is not None:
            mgr.load(into=state)
            torch.set_rng_state(state["rng"]["torch"])
            np.random.set_state(state["rng"]["numpy"])
            random.setstate(state["rng"]["python"])
            assert model[0].weight is model[2].weight  # still tied
        for step in range(state["step"] + 1, 7):
            ids = torch.from_numpy(np.random.randint(0, 16, size=(4, 5)))
            ids[0, random.randrange(5)] = 0
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            opt.zero_grad(); loss.backward(); opt.step(); sched.step()
            stats += [loss.item(), step, 1]
            losses.append(f"{loss.item():.8f}")
            state["step"] = step
            state["rng"] = rng()
            mgr.save(step, state)
            if step == stop:
                break
    print(" ".join(losses), stats.tolist())
    """
)


def test_a_full_trainer_state_resumes_in_a_fresh_process_with_the_same_losses(tmp_path):
    path = tmp_path / "trainer.py"
    path.write_text(TRAINER)

    def run(root: str, stop: int) -> list[str]:
        cmd = [sys.executable, str(path), root, str(stop)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        losses, _, stats = done.stdout.partition("[")
        return losses.split(), stats

    whole, stats = run(str(tmp_path / "a"), 99)
    first, _ = run(str(tmp_path / "b"), 3)
    rest, resumed_stats = run(str(tmp_path / "b"), 99)
    assert len(whole) == 6
    assert first + rest == whole  # RNGs, scheduler, moments and the tied weight all resumed
    assert resumed_stats == stats  # and the numpy array


def test_the_sync_manager_takes_the_async_managers_options():
    """The options are declared once, by the async manager: the sync one shows the same
    signature and hands them on, refusing on_sigterm (its loop is not the main thread)."""
    assert inspect.signature(CheckpointManager) == inspect.signature(AsyncCheckpointManager)
    with pytest.raises(TypeError, match="on_sigterm"):
        CheckpointManager("memory://x", on_sigterm="flush")
    with pytest.raises(TypeError, match="bogus"):
        CheckpointManager("memory://x", bogus=1)
    with pytest.raises(ValueError, match="max_pending"):
        CheckpointManager("memory://x", max_pending=0)
