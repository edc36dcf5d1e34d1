"""One rank of the recorded two-rank run: ``SCENARIO RANK WORLD STORE ROOT OUT ARGS``, run by
``_support.ranks.run_ranks``; saves steps 1, 2 and 3 with LatestN(2) through ``crashrec://``,
marking each ``await handle`` in the log."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from _crash_record import LEASE_TTL, state_for
from _support.ranks import serve_rank
from aiockpt_crash_recorder import mark

from aiockpt import AsyncCheckpointManager, LatestN


async def record(rank: int, world: int, root: str, args: dict) -> dict:
    log = args["log"]
    async with AsyncCheckpointManager(
        f"crashrec://{root}",
        storage_options={"log": log},
        retention=LatestN(2),
        lease_ttl=LEASE_TTL,
        dist_timeout=120,
    ) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, state_for(step)))
            mark(log, durable=step, rank=rank)
        return {"steps": await mgr.steps()}


if __name__ == "__main__":
    serve_rank({"record": record})
