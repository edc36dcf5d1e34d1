"""A writer in a process of its own, for the lease tests: ``ROOT TTL``; it opens a manager with
LatestN(1) retention, then reads commands from stdin (``save STEP``, ``stage STEP MIB``,
``close``) and answers each with one JSON line on stdout.

Also a rank of a multi-rank run: ``SCENARIO RANK WORLD STORE ROOT OUT ARGS`` (see run_ranks).
"""

from __future__ import annotations

import json
import os
import sys

import anyio
import torch
from _support.ranks import serve_rank

from aiockpt import AsyncCheckpointManager, LatestN


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")  # one write: a line never splits
    sys.stdout.flush()


async def writer(root: str, ttl: float) -> None:
    on_sigterm = os.environ.get("LEASE_WORKER_ON_SIGTERM")  # "flush" to test preemption
    async with AsyncCheckpointManager(
        root, retention=LatestN(1), lease_ttl=ttl, on_sigterm=on_sigterm
    ) as mgr:
        say({"ready": True, "daemon": mgr.daemon_pid})
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            cmd = line.split()
            if not cmd or cmd[0] == "close":
                break
            step = int(cmd[1])
            if cmd[0] == "stage":  # ``stage STEP MIB``: staged, not waited for
                await mgr.save(step, {"w": torch.ones(int(cmd[2]) << 18)})
                say({"staged": step})
                continue
            try:
                await (await mgr.save(step, {"w": torch.full((4,), float(step))}))
                say({"saved": step})
            except Exception as e:
                say({"error": type(e).__name__, "message": str(e)})
    say({"closed": True})


async def open_leased(rank: int, world: int, root: str, args: dict) -> dict:
    """Every rank opens a manager on a root another writer holds: every rank must refuse."""
    try:
        async with AsyncCheckpointManager(root):
            return {"opened": True}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)}


async def taken_over(rank: int, world: int, root: str, args: dict) -> dict:
    """A two-rank job saves; then a writer of its own (rank 0 alone, with takeover=True) takes
    the root and saves: the job's next save must fail on every rank and commit nothing."""
    import torch.distributed as dist

    alone = dist.new_group([0])
    out: dict = {}
    async with AsyncCheckpointManager(root) as job:
        await (await job.save(1, {"w": torch.full((4,), float(rank))}))
        if rank == 0:
            async with AsyncCheckpointManager(root, process_group=alone, takeover=True) as new:
                await (await new.save(2, {"w": torch.zeros(4)}))
        dist.barrier()
        try:
            await (await job.save(3, {"w": torch.ones(4)}))
            out["saved"] = 3
        except Exception as e:
            out["error"] = type(e).__name__
            out["message"] = str(e)
    return out


async def saved_then_killed(rank: int, world: int, root: str, args: dict) -> dict:
    """A two-rank job saves steps 1 and 2, says so in ``args["ready"]``-RANK, then trains on
    (sleeps) until the test kills it whole, daemons included."""
    async with AsyncCheckpointManager(root, retention=LatestN(1), lease_ttl=60.0) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, {"w": torch.full((4,), float(step + rank))}))
        ready = {"pid": os.getpid(), "daemon": mgr.daemon_pid}
        with open(f"{args['ready']}-{rank}", "w") as f:
            json.dump(ready, f)
        await anyio.sleep(3600)
    return {}


async def reopened(rank: int, world: int, root: str, args: dict) -> dict:
    """The same job started again at once: each rank opens the root (no takeover) and
    resumes from the last committed step."""
    import time

    events: list = []
    t0 = time.monotonic()
    async with AsyncCheckpointManager(
        root, retention=LatestN(1), lease_ttl=60.0, event_handlers=[events.append]
    ) as mgr:
        opened = time.monotonic() - t0
        w = (await mgr.load())["w"]
        return {
            "opened": opened,
            "steps": await mgr.steps(),
            "w": w.tolist(),
            "takeover": [e.detail for e in events if e.name == "lease.takeover"],
        }


SCENARIOS = {
    "open_leased": open_leased,
    "taken_over": taken_over,
    "saved_then_killed": saved_then_killed,
    "reopened": reopened,
}

if __name__ == "__main__":
    if sys.argv[1] in SCENARIOS:
        serve_rank(SCENARIOS)
    else:
        os.setpgid(0, 0)  # a group of its own (with its daemon), to stop or kill it whole
        anyio.run(writer, sys.argv[1], float(sys.argv[2]))
