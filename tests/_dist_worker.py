"""One rank of a multi-rank test: ``python _dist_worker.py SCENARIO RANK WORLD STORE ROOT OUT``.

Runs a scenario against a real gloo process group and writes what it saw to OUT as JSON.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from _support.ranks import serve_rank

from aiockpt import AsyncCheckpointManager, LatestN


def state_for(rank: int, size: int = 16) -> dict:
    return {
        "own": torch.full((size,), float(rank)),
        "rank": rank,
        "shared": {"w": torch.arange(10, dtype=torch.float32), "note": "same everywhere"},
    }


def err(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e), "ranks": getattr(e, "ranks", None)}


async def save_load(rank: int, world: int, root: str) -> dict:
    requests = []

    def on_event(event) -> None:
        if event.name == "save.committed":
            requests.append(event.requests)

    async with AsyncCheckpointManager(
        root, dist_timeout=60, retention=LatestN(1), event_handlers=[on_event]
    ) as mgr:
        for step in (1, 2):
            if rank == world - 1:
                time.sleep(1.0)  # the slowest rank: a storage poll loop would show
            info = await (
                await mgr.save(step, state_for(rank + step), metrics={"loss": 1.0 / step})
            )
        loaded = await mgr.load()
        return {
            "steps": await mgr.steps(),
            "url": info.url,
            "own": loaded["own"].tolist(),
            "rank": loaded["rank"],
            "requests": requests,
        }


async def kill_daemon(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(1, state_for(rank)))
        big = {"own": torch.randn(32 << 20)}  # 128 MiB: still being written when killed
        t0 = time.monotonic()
        handle = await mgr.save(2, big)
        if rank == 1:
            os.kill(mgr.daemon_pid, signal.SIGKILL)
        try:
            await handle
            out["second"] = "committed"
        except Exception as e:
            out["second"] = err(e)
        out["seconds"] = time.monotonic() - t0
        await (await mgr.save(3, state_for(rank)))
        out["steps"] = await mgr.steps()
        out["own"] = (await mgr.load(1))["own"].tolist()
    return out


async def mismatch(rank: int, world: int, root: str) -> dict:
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        try:
            await mgr.save(10 + rank, state_for(rank))
            result = {"error": None}
        except Exception as e:
            result = {"error": err(e)}
        # refused on the last rank only
        bad = {"own": object()} if rank == world - 1 else state_for(rank)
        try:
            await mgr.save(20, bad)
            result["refused"] = None
        except Exception as e:
            result["refused"] = err(e)
        await (await mgr.save(30, state_for(rank)))
        result["steps"] = await mgr.steps()
    return result


async def replicated(rank: int, world: int, root: str) -> dict:
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(5, {"shared": state_for(0)["shared"], "step": 5}))
        await (await mgr.save(6, state_for(rank)))
    return {}


async def late_refusal(rank: int, world: int, root: str) -> dict:
    """A tensor of a reused mapping turns unsavable in place: only the copy finds out, after
    every rank agreed to save the step."""
    state = {"model": {f"w{i:02d}": torch.full((4,), float(rank)) for i in range(32)}}
    result: dict = {}
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(1, state))
        if rank == world - 1:
            state["model"]["w03"].data = torch.zeros(4, dtype=torch.complex128)
        t0 = time.monotonic()
        try:
            await (await mgr.save(2, state))
            result["second"] = "committed"
        except Exception as e:
            result["second"] = err(e)
        result["seconds"] = time.monotonic() - t0
        state["model"]["w03"] = torch.zeros(4)
        await (await mgr.save(3, state))
        result["steps"] = await mgr.steps()
    return result


class _Exploding(Mapping):
    """A lazy state dict that fails as it is read, not as it is made."""

    def __getitem__(self, key: str) -> Any:
        raise RuntimeError("state_dict exploded")

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("state_dict exploded")

    def __len__(self) -> int:
        return 1


class _Flaky:
    """A stateful object whose state is unreadable while ``failing`` is set: its
    ``state_dict()`` raises, or (``lazily``) returns a mapping that raises once it is read."""

    def __init__(self, rank: int) -> None:
        self.w = torch.full((8,), float(rank))
        self.failing = self.lazily = False

    def state_dict(self) -> Mapping:
        if self.failing and self.lazily:
            return _Exploding()
        if self.failing:
            raise RuntimeError("state_dict exploded")
        return {"w": self.w}

    def load_state_dict(self, sd: dict) -> None:
        self.w.copy_(sd["w"])


async def state_dict_raises(rank: int, world: int, root: str) -> dict:
    """The last rank's state cannot be read (state_dict() raises, or what it returns does)
    every other save; each save after a failed one commits on every rank."""
    flaky = _Flaky(rank)
    state = {"model": flaky, "own": torch.full((4,), float(rank))}
    failures: list[dict] = []
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        for round_ in range(5):
            flaky.failing, flaky.lazily = rank == world - 1, round_ % 2 == 0
            t0 = time.monotonic()
            try:
                await (await mgr.save(2 * round_ + 1, state))
                failures.append({"error": None})
            except Exception as e:
                failures.append({**err(e), "seconds": time.monotonic() - t0})
            flaky.failing = False
            await (await mgr.save(2 * round_ + 2, state))
        return {"failures": failures, "steps": await mgr.steps()}


async def late_rank(rank: int, world: int, root: str) -> dict:
    """The last rank comes to a save long after dist_timeout: the others give up, naming it."""
    result: dict = {}
    async with AsyncCheckpointManager(root, dist_timeout=2) as mgr:
        if rank == world - 1:
            time.sleep(9)  # past the others' deadline and their wait for each other's marks
        t0 = time.monotonic()
        try:
            await (await mgr.save(1, state_for(rank)))
            result["error"] = None
        except Exception as e:
            result["error"] = err(e)
        result["seconds"] = time.monotonic() - t0
    return result


SCENARIOS = {
    f.__name__: f
    for f in (
        save_load,
        kill_daemon,
        mismatch,
        replicated,
        late_refusal,
        state_dict_raises,
        late_rank,
    )
}


if __name__ == "__main__":
    serve_rank(SCENARIOS, with_args=False)
