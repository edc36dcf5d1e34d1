"""One rank of a multi-rank test: ``python _dist_worker.py SCENARIO RANK WORLD STORE ROOT OUT``.

Runs a scenario against a real gloo process group and writes what it saw to OUT as JSON.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
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
        for round_ in range(10):
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


class _Picky:
    """A stateful object whose ``load_state_dict()`` raises while ``failing`` is set."""

    def __init__(self, rank: int) -> None:
        self.w = torch.full((4,), float(rank))
        self.failing = False

    def state_dict(self) -> dict:
        return {"w": self.w}

    def load_state_dict(self, sd: dict) -> None:
        if self.failing:
            raise RuntimeError("load_state_dict exploded")
        self.w.copy_(sd["w"])


def flip_a_byte(root: str, step: int, rank: int) -> None:
    """Corrupt a byte of the first tensor's data in ``rank``'s shard of ``step``."""
    step_dir = os.path.join(root, f"step_{step:012d}")
    with open(os.path.join(step_dir, "manifest.json")) as f:
        shard = json.load(f)["shards"][rank]["file"]
    with open(os.path.join(step_dir, shard), "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        start = min(v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
        f.seek(8 + n + start)
        byte = f.read(1)
        f.seek(8 + n + start)
        f.write(bytes([byte[0] ^ 0xFF]))


async def load_failures(rank: int, world: int, root: str, how: str) -> dict:
    """A load that fails on the last rank only (``how``): its shard corrupt, its target
    holding a key the checkpoint lacks, or a module there refusing its state."""
    import torch.distributed as dist

    picky = _Picky(rank)
    state = {"model": picky, "own": torch.full((16,), float(rank)), "step": 1}
    result: dict = {}
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(1, state))
        last = rank == world - 1
        if how == "corrupt" and last:
            flip_a_byte(root, 1, rank)
        dist.barrier()
        picky.w.fill_(-1.0)
        state["own"].fill_(-1.0)
        into = dict(state, extra=torch.zeros(2)) if how == "missing" and last else state
        picky.failing = how == "load_state_dict" and last
        t0 = time.monotonic()
        try:
            await mgr.load(1, into=into)
            result["error"] = None
        except Exception as e:
            result["error"] = err(e)
        result["seconds"] = time.monotonic() - t0
        result["own"] = state["own"].tolist()
        result["model"] = picky.w.tolist()
        # the group is still in step: a load every rank can do succeeds everywhere
        picky.failing = False
        if how == "corrupt":  # step 1 stays unreadable: load a step saved now
            state["own"].fill_(float(rank))
            await (await mgr.save(2, state))
            state["own"].fill_(-1.0)
        loaded = await mgr.load(2 if how == "corrupt" else 1, into=state)
        result["after"] = loaded["own"].tolist()
    return result


class _Collective:
    """A stateful object whose ``load_state_dict()`` runs an all_reduce, as a module whose
    load synchronises its ranks does; it notes whether the ranks were restoring it too."""

    def __init__(self, name: str, seen: list) -> None:
        self.name, self.seen = name, seen
        self.w = torch.zeros(4)

    def state_dict(self) -> dict:
        return {"w": self.w}

    def load_state_dict(self, sd: dict) -> None:
        import torch.distributed as dist

        mine = torch.tensor([float(ord(self.name))])
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        self.seen.append([self.name, low.item() == high.item()])
        self.w.copy_(sd["w"])


class _Drawing(_Collective):
    """One that also draws from a generator as it loads (an initialisation, say)."""

    def __init__(self, name: str, seen: list, gen: torch.Generator) -> None:
        super().__init__(name, seen)
        self.gen = gen

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        torch.rand(8, generator=self.gen)


async def key_orders(rank: int, world: int, root: str) -> dict:
    """The ranks hold the same keys in different orders; restoring runs collectives."""
    seen: list = []
    gen = torch.Generator().manual_seed(rank)
    parts = {name: _Collective(name, seen) for name in "abcd"}
    parts["e"] = _Drawing("e", seen, gen)
    names = "abcde" if rank % 2 == 0 else "edcba"
    state = {"rng": gen, "parts": {name: parts[name] for name in names}}
    if rank % 2:
        state = {"parts": state["parts"], "rng": gen}
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(1, state))
        expected = torch.rand(4, generator=gen).tolist()  # what the saved state draws next
        await mgr.load(1, into=state)
        drawn = torch.rand(4, generator=gen).tolist()
    return {"seen": seen, "rng_restored": drawn == expected}


async def dead_rank(rank: int, world: int, root: str) -> dict:
    """The last rank's process ends abruptly before a save: the others name it."""
    result: dict = {}
    async with AsyncCheckpointManager(root, dist_timeout=30) as mgr:
        if rank == world - 1:
            with open(sys.argv[6], "w") as f:  # this rank's OUT: it says nothing more
                json.dump(result, f)
            os._exit(0)
        time.sleep(1.0)  # past its death
        t0 = time.monotonic()
        try:
            await (await mgr.save(1, state_for(rank)))
            result["error"] = None
        except Exception as e:
            result["error"] = err(e)
        result["seconds"] = time.monotonic() - t0
    return result


def _saved_by(rank: int) -> dict:
    """What each rank of ``global_keys`` saves: a full state on rank 0 only, a value ranks 0
    and 1 saved differently, one ranks 1 and 2 saved identically, and each rank's own."""
    state: dict = {"mine": torch.full((4,), float(rank)), "step": 7}
    if rank == 0:
        state["full"] = {"w": torch.arange(12, dtype=torch.float32), "b": torch.ones(3)}
        state["note"] = "rank 0 only"
    if rank in (0, 1):
        state["diff"] = torch.tensor([float(rank)])
    if rank in (1, 2):
        state["both"] = {"v": torch.arange(5, dtype=torch.int64), "tag": "same"}
    return state


def _blank(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, -1)
    return None if isinstance(value, str) else 0


async def global_keys(rank: int, world: int, root: str) -> dict:
    """A key saved by some ranks only is loadable on every rank (one global namespace)."""
    result: dict = {}
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(1, _saved_by(rank)))
        # strict: each rank's target is what it saved, plus what others saved that it lacks
        target = _blank({**_saved_by(0), **_saved_by(1), **_saved_by(rank)})
        target.pop("diff", None)
        if rank in (0, 1):
            target["diff"] = torch.zeros(1)
        target.pop("note", None)
        if rank == 0:
            target["note"] = ""
        await mgr.load(1, into=target)
        result["into"] = {
            "full": {k: v.tolist() for k, v in target["full"].items()},
            "both": [target["both"]["v"].tolist(), target["both"]["tag"]],
            "mine": target["mine"].tolist(),
            "step": target["step"],
        }
        fresh = await mgr.load(1, keys=["full", "both/v"])
        result["fresh"] = [fresh["full"]["w"].tolist(), fresh["both"]["v"].tolist()]
        try:  # rank 2 saved no "diff"; ranks 0 and 1 saved different values
            await mgr.load(1, keys=["diff"])
            result["diff"] = None
        except Exception as e:
            result["diff"] = err(e)
    return result


async def replace_and_delete(rank: int, world: int, root: str) -> dict:
    """save(overwrite=True) and delete() on every rank of a multi-rank run."""
    out: dict = {}
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, {"own": torch.full((4,), float(rank + step))}))
        await (await mgr.save(2, {"own": torch.full((4,), 10.0 + rank)}, overwrite=True))
        out["replaced"] = (await mgr.load(2))["own"].tolist()
        step_dir = os.path.join(root, f"step_{2:012d}")
        out["files"] = sorted(f for f in os.listdir(step_dir) if f.endswith(".safetensors"))
        try:
            await mgr.delete(2)  # the newest: refused on every rank
            out["newest"] = None
        except Exception as e:
            out["newest"] = err(e)
        await mgr.delete(1)
        out["steps"] = await mgr.steps()
        out["on_disk"] = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    return out


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
        key_orders,
        dead_rank,
        global_keys,
        replace_and_delete,
    )
}

SCENARIOS.update(
    {
        f"load_fails_{how}": functools.partial(load_failures, how=how)
        for how in ("corrupt", "missing", "load_state_dict")
    }
)

if __name__ == "__main__":
    serve_rank(SCENARIOS, with_args=False)
