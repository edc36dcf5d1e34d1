"""The recorded runs of the crash-point checker: real managers and daemons saving through the
``crashrec://`` storage, and what each step held, to compare loads with."""

from __future__ import annotations

import base64
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from aiockpt_crash_recorder import ENV, RecordingStorage, mark

from aiockpt import AsyncCheckpointManager, LatestN, LocalTier
from aiockpt.errors import LeaseLostError

#: Long enough that no renewal lands in a recorded run, whatever the machine's load: every
#: lease in a crash state is then a dead writer's unexpired one (see docs/crash-points.md).
LEASE_TTL = 3600.0


def state_for(step: int, rank: int = 0) -> dict[str, Any]:
    """What the trainer saves at ``step``: tensors of three dtypes and plain values."""
    return {
        "model": {
            "w": torch.arange(24, dtype=torch.float32).view(4, 6) * step,
            "b": torch.full((5,), step, dtype=torch.int64),
            "mask": torch.arange(7) % (step + 1) == 0,
        },
        "step": step,
        "note": f"step {step}",
        "rank": rank,
    }


def incremental_state(step: int, rank: int = 0) -> dict[str, Any]:
    """What the incremental scenario saves: a frozen 1 MiB tensor (a block of its own, which
    later saves refer to) and small values that change."""
    return {
        "frozen": torch.arange(1 << 18, dtype=torch.float32),
        "small": torch.full((5,), step, dtype=torch.int64),
        "step": step,
        "rank": rank,
    }


def fenced_state(step: int) -> dict[str, Any]:
    """What the fenced writer of the two-writer run tries to save at ``step``: the layout of
    :func:`state_for`, so its shard's bytes lie where the new holder's do, other values."""
    return state_for(-step)


#: What each scenario's steps held, by the name a recording carries in ``meta["state"]``.
EXPECTED = {"plain": state_for, "incremental": incremental_state}


@dataclass
class Recording:
    """A recorded run: its log records, in order."""

    records: list[dict[str, Any]]
    world: int = 1
    meta: dict[str, Any] = field(default_factory=dict)


def read_log(path: str, world: int = 1) -> Recording:
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    for r in records:
        if "data" in r:
            r["data"] = base64.b64decode(r["data"])
    return Recording(records, world)


def crashed_save(url: str, log: str, step: int, shard: bytes) -> None:
    """What a daemon killed while writing ``step`` leaves: the step directory and the first
    half of its shard, made by the same Storage calls the daemon makes."""
    storage = RecordingStorage(url.partition("://")[2], log=log, url=url)
    step_dir = f"step_{step:012d}"
    storage.makedirs(step_dir)
    storage.write_file(f"{step_dir}/shard_r00000.{'0' * 16}.safetensors", [memoryview(shard)])


def half_shard(root: str, step: int) -> bytes:
    """The first half of rank 0's shard of ``step`` under ``root``: what a save cut short
    by a daemon's death leaves."""
    step_dir = os.path.join(root, f"step_{step:012d}")
    (name,) = (n for n in os.listdir(step_dir) if n.startswith("shard_r00000."))
    with open(os.path.join(step_dir, name), "rb") as f:
        shard = f.read()
    return shard[: len(shard) // 2]


async def record_single(root: str, log: str) -> Recording:
    """One rank: saves 1 and 2; a save of 3 cut short by a daemon death (a partial); save 4,
    whose retention pass (LatestN(2)) deletes step 1; then a new manager opens the root and
    collects the partial step 3."""
    os.makedirs(root)
    url, options = f"crashrec://{root}", {"log": log}
    async with AsyncCheckpointManager(
        url, storage_options=options, retention=LatestN(2), lease_ttl=LEASE_TTL
    ) as mgr:
        for step in (1, 2, 4):
            if step == 4:
                crashed_save(url, log, 3, half_shard(root, 2))
            await (await mgr.save(step, state_for(step)))
            mark(log, durable=step)
    async with AsyncCheckpointManager(url, storage_options=options, lease_ttl=LEASE_TTL):
        mark(log, opened=True)
    return read_log(log)


async def record_incremental(root: str, log: str) -> Recording:
    """One rank, incremental checkpoints: saves 1 to 3 of :func:`incremental_state` with
    retention LatestN(1). Step 2 reads its frozen tensor from step 1's file, so deleting step 1
    retires that file; step 3 reads it too, and deleting step 2 removes all of step 2's
    directory. Then a new manager opens the root."""
    os.makedirs(root)
    url, options = f"crashrec://{root}", {"log": log}
    async with AsyncCheckpointManager(
        url, storage_options=options, retention=LatestN(1), lease_ttl=LEASE_TTL
    ) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, incremental_state(step)))
            mark(log, durable=step)
    async with AsyncCheckpointManager(url, storage_options=options, lease_ttl=LEASE_TTL):
        mark(log, opened=True)
    rec = read_log(log)
    rec.meta["state"] = "incremental"
    return rec


#: The two-writer run: the step both writers save (the first pauses in the middle of it).
CONTESTED = 2


async def record_two_writers(root: str, log: str) -> Recording:
    """Writer A (``LatestN(2)``) commits step 1, then pauses half way through its shard of
    step 2. Writer B opens the root with ``takeover=True``, commits step 2 and step 3 (whose
    retention pass deletes step 1) and closes. Then A resumes: it finishes its write and its
    save fails with LeaseLostError. ``meta["fenced"]`` names A, whose records carry
    ``"writer": "a"``; B's carry ``"b"``."""
    os.makedirs(root)
    url = f"crashrec://{root}"
    here = os.path.dirname(root)
    gate, reached = os.path.join(here, "gate"), os.path.join(here, "reached")
    step_dir = f"step_{CONTESTED:012d}"
    a_options = {"log": log, "writer": "a", "pause": step_dir, "gate": gate, "reached": reached}
    outcome: dict[str, BaseException | None] = {"b": None}

    async def writer_a() -> None:
        async with AsyncCheckpointManager(
            url, storage_options=a_options, retention=LatestN(2), lease_ttl=LEASE_TTL
        ) as mgr:
            await (await mgr.save(1, state_for(1)))
            mark(log, durable=1, writer="a")
            try:
                await (await mgr.save(CONTESTED, fenced_state(CONTESTED)))
            except LeaseLostError as e:
                outcome["a"] = e
            else:
                outcome["a"] = None

    async with anyio.create_task_group() as tg:
        tg.start_soon(writer_a)
        try:
            with anyio.fail_after(120):
                while not os.path.exists(reached):
                    await anyio.sleep(0.02)
            async with AsyncCheckpointManager(
                url,
                storage_options={"log": log, "writer": "b"},
                retention=LatestN(2),
                lease_ttl=LEASE_TTL,
                takeover=True,
            ) as mgr:
                for step in (CONTESTED, CONTESTED + 1):
                    await (await mgr.save(step, state_for(step)))
                    mark(log, durable=step, writer="b")
        except Exception as e:  # A ends its save first, not cancelled in the middle of it
            outcome["b"] = e
        finally:  # A goes on whatever happened to B: its daemon must not wait forever
            with open(gate, "w"):
                pass
    if outcome["b"] is not None:
        raise AssertionError(f"writer B failed: {outcome['b']!r}") from outcome["b"]
    assert isinstance(outcome["a"], LeaseLostError), f"writer A's save: {outcome['a']!r}"
    rec = read_log(log)
    rec.meta["fenced"] = "a"
    return rec


#: The local-tier run: its persist_every and its tier's keep.
TIER_EVERY, TIER_KEEP = 2, 2


async def record_tier(root: str, tier: str, log: str) -> Recording:
    """One rank with a recorded local tier, ``LocalTier("crashrec://TIER", keep=2)`` (the
    daemon opens it with no storage options: the log is named by ``$AIOCKPT_CRASH_LOG``,
    which it inherits), and a plain root, ``persist_every=2``: saves 1 and 2; a save of 3 cut
    short in the tier (a partial there); saves 4 and 5, whose retention passes in the tier
    delete step 1 (the tier's alone) and step 2 (the root holds it too). Then a new manager
    opens both and collects the partial. The root is not recorded: it stands for another
    machine's storage, which a crash of this host leaves as it was. After each ``await
    handle`` a copy of the root is kept, ``meta["tier"]["snapshots"]/STEP``: the root a
    crash after that point and before the next one finds."""
    os.makedirs(root)
    os.makedirs(tier)
    snapshots = os.path.join(os.path.dirname(root), "snapshots")
    url = f"crashrec://{tier}"
    local = LocalTier(url, keep=TIER_KEEP)
    before = os.environ.get(ENV)
    os.environ[ENV] = log
    try:
        async with AsyncCheckpointManager(
            root, local=local, persist_every=TIER_EVERY, lease_ttl=LEASE_TTL
        ) as mgr:
            for step in (1, 2, 4, 5):
                if step == 4:
                    crashed_save(url, log, 3, half_shard(tier, 2))
                await (await mgr.save(step, state_for(step)))
                mark(log, durable=step)
                shutil.copytree(root, os.path.join(snapshots, str(step)))
        async with AsyncCheckpointManager(
            root, local=local, persist_every=TIER_EVERY, lease_ttl=LEASE_TTL
        ):
            mark(log, opened=True)
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before
    rec = read_log(log)
    rec.meta["tier"] = {"snapshots": snapshots, "every": TIER_EVERY, "keep": TIER_KEEP}
    return rec
