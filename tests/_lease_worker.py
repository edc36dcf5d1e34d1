"""A writer in a process of its own, for the lease tests: ``ROOT TTL``; it opens a manager with
LatestN(1) retention, then reads commands from stdin (``save STEP``, ``close``) and answers
each with one JSON line on stdout.

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
    async with AsyncCheckpointManager(root, retention=LatestN(1), lease_ttl=ttl) as mgr:
        say({"ready": True, "daemon": mgr.daemon_pid})
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            cmd = line.split()
            if not cmd or cmd[0] == "close":
                break
            step = int(cmd[1])
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


SCENARIOS = {"open_leased": open_leased}

if __name__ == "__main__":
    if sys.argv[1] in SCENARIOS:
        serve_rank(SCENARIOS)
    else:
        os.setpgid(0, 0)  # a group of its own (with its daemon), to stop or kill it whole
        anyio.run(writer, sys.argv[1], float(sys.argv[2]))
