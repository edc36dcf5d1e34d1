"""One rank of a local-tier test: ``python _tiers_worker.py SCENARIO RANK WORLD STORE ROOT OUT
ARGS``. ARGS (JSON) names each rank's host (``hosts``, set as AIOCKPT_HOST_ID) and each
host's local directory (``local``, by host), and the scenario's own settings."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from _support.ranks import serve_rank

from aiockpt import AsyncCheckpointManager, LatestN, LocalTier


def state_for(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "model": {"w": torch.randn(96, 64, generator=g), "b": torch.randn(64, generator=g)},
        "step": step,
        "rank": rank,
    }


def manager(rank: int, root: str, args: dict, events: list | None = None) -> Any:
    host = args["hosts"][rank]
    os.environ["AIOCKPT_HOST_ID"] = host
    keep, replicas = args.get("keep", 2), args.get("replicas", 0)
    path = args["tier_of_rank"][rank] if "tier_of_rank" in args else args["local"][host]
    tier = LocalTier(path, keep=keep, replicas=replicas)
    return AsyncCheckpointManager(
        root,
        dist_timeout=args.get("dist_timeout", 60),
        retention=LatestN(args.get("root_keep", 3)),
        local=tier,
        persist_every=args.get("persist_every", 5),
        event_handlers=[] if events is None else [events.append],
    )


async def save(rank: int, world: int, root: str, args: dict) -> dict:
    events: list = []
    async with manager(rank, root, args, events) as mgr:
        for step in range(1, args.get("last", 7) + 1):
            await (await mgr.save(step, state_for(rank, step)))
        steps = await mgr.steps()
    return {"steps": steps, "events": [e.name for e in events if e.name.startswith("tier.")]}


async def resume(rank: int, world: int, root: str, args: dict) -> dict:
    events: list = []
    async with manager(rank, root, args, events) as mgr:
        latest = await mgr.latest_step()
        target = state_for(rank, 0)
        await mgr.load(into=target)
        want = state_for(rank, target["step"])
        exact = all(torch.equal(target["model"][k], want["model"][k]) for k in ("w", "b"))
        plain = await mgr.load()
        exact = exact and torch.equal(plain["model"]["w"], want["model"]["w"])
        tiers = sorted({e.tier for e in events if e.name == "load.tier"})
        incomplete = sorted({e.step for e in events if e.name == "tier.incomplete"})
    return {
        "latest": latest,
        "step": target["step"],
        "rank": target["rank"],
        "exact": exact,
        "tiers": tiers,
        "incomplete": incomplete,
    }


async def try_resume(rank: int, world: int, root: str, args: dict) -> dict:
    """Agree on the latest step, then, where ``kill`` names this rank's host, lose this
    rank's daemon (its replicas' server with it) before any rank loads; then load that step:
    its error's class and words on this rank, or None, and the details of its tier.failed
    events."""
    events: list = []
    async with manager(rank, root, args, events) as mgr:
        latest = await mgr.latest_step()
        if args["hosts"][rank] == args.get("kill"):
            pid = mgr.daemon_pid
            os.kill(pid, signal.SIGKILL)
            while not dead(pid):
                time.sleep(0.05)
        dist.barrier()
        error = None
        try:
            await mgr.load(latest, into=state_for(rank, 0))
        except Exception as e:
            error = [type(e).__name__, str(e)]
    failed = [e.detail for e in events if e.name == "tier.failed"]
    return {"latest": latest, "error": error, "failed": failed}


def dead(pid: int) -> bool:
    """Whether process ``pid`` is a zombie: gone, its sockets closed, not yet reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:  # reaped already
        return True


async def delete(rank: int, world: int, root: str, args: dict) -> dict:
    async with manager(rank, root, args) as mgr:
        await mgr.delete(args["delete"])
        steps = await mgr.steps()
    return {"steps": steps}


def full_weight(step: int) -> torch.Tensor:
    """The whole of the sharded weight that save_sharded saves at ``step``."""
    return torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4) + 100 * step


async def save_sharded(rank: int, world: int, root: str, args: dict) -> dict:
    """Steps 1..7 of one weight sharded by rows over every rank (a DTensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    async with manager(rank, root, args) as mgr:
        for step in range(1, 8):
            w = distribute_tensor(full_weight(step), mesh, [Shard(0)])
            await (await mgr.save(step, {"w": w, "step": step}))
    return {}


async def try_delete(rank: int, world: int, root: str, args: dict) -> dict:
    """delete(), its error's class and words on this rank, or None; then the steps."""
    async with manager(rank, root, args) as mgr:
        error = None
        try:
            await mgr.delete(args["delete"], allow_latest=args.get("allow_latest", False))
        except Exception as e:
            error = [type(e).__name__, str(e)]
        steps = await mgr.steps()
    return {"error": error, "steps": steps}


async def opens(rank: int, world: int, root: str, args: dict) -> dict:
    """Open, or the error's class and words."""
    try:
        async with manager(rank, root, args) as mgr:
            return {"error": None, "steps": await mgr.steps()}
    except Exception as e:
        return {"error": [type(e).__name__, str(e)]}


SCENARIOS = {
    "save": save,
    "resume": resume,
    "try_resume": try_resume,
    "delete": delete,
    "try_delete": try_delete,
    "opens": opens,
    "save_sharded": save_sharded,
}

if __name__ == "__main__":
    serve_rank(SCENARIOS)
