"""Saves under a staging-memory cap: stall, durable time and staging memory at several caps.

One state (default 1 GiB in 32 float32 tensors) is saved to a local root by managers with
``staging_memory`` of 25 %, 50 % and 100 % of the shard and with no cap, alternating, each save
a fresh step with every tensor changed (so deduplication writes everything, as a trained
state would). For each it prints the medians of:

- ``stall``: ``await mgr.save(...)`` returning (a capped save returns once its last window
  is copied, so the stall includes writing the windows before it);
- ``durable``: the save committed (``await handle``);
- ``staging``: the most the manager's slab pool held (its own accounting), and that ÷ state;
- ``rss+``: the trainer's peak RSS over the run, minus its RSS before the first save, ÷ state
  (from ``/proc/self/status`` VmHWM after resetting it through ``/proc/self/clear_refs``).

Then, in the same manager, ``load(into=...)`` of the last step, the page cache dropped before
each when this process may (``/proc/sys/vm/drop_caches``): its median time, the most the pool
held during the loads, and the trainer's peak RSS during them (minus its RSS before the
loads). Under a cap smaller than the shard a load reads through two window slabs and reads
the bytes twice (checked whole first, then copied window by window).

Beside them: ``memcpy`` of the state into a warm buffer (the stall's floor) and ``write+fsync``
of the same bytes with ``os.write`` (the durable floor), in the same run.

    python benchmarks/staging_cap_bench.py [--mib 1024] [--repeat 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import anyio
import torch
from dedup_load_bench import drop_cache

from aiockpt import AsyncCheckpointManager

MiB = 1 << 20
TENSORS = 32


def rss_reset() -> None:
    """Reset the peak RSS the kernel reports (VmHWM) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def floors(state: dict[str, torch.Tensor], where: str, repeat: int) -> tuple[float, float]:
    """Median memcpy of the state into a warm buffer, and median write+fsync of its bytes."""
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for d, s in zip(dst.values(), state.values(), strict=True):
        d.copy_(s)
    copies, writes = [], []
    path = os.path.join(where, "plain.bin")
    for _ in range(repeat):
        t = time.perf_counter()
        for d, s in zip(dst.values(), state.values(), strict=True):
            d.copy_(s)
        copies.append(time.perf_counter() - t)
        t = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for s in state.values():
                os.write(fd, memoryview(s.numpy()).cast("B"))
            os.fsync(fd)
        finally:
            os.close(fd)
        writes.append(time.perf_counter() - t)
        os.unlink(path)
    return statistics.median(copies), statistics.median(writes)


async def run_cap(
    cap: float | None, state: dict[str, torch.Tensor], root: str, repeat: int
) -> dict[str, float]:
    stalls, durables = [], []
    base = vm("VmRSS")
    rss_reset()
    async with AsyncCheckpointManager(root, staging_memory=cap) as mgr:
        for step in range(repeat + 1):
            for v in state.values():
                v.add_(1.0)
            t = time.perf_counter()
            handle = await mgr.save(step, {"model": state})
            staged = time.perf_counter()
            await handle
            done = time.perf_counter()
            if step:  # the first save of a manager also makes its slabs and daemon
                stalls.append(staged - t)
                durables.append(done - t)
        peak = mgr._pool.peak
        rss = vm("VmHWM") - base
        mgr._pool.peak = mgr._pool.held  # the loads' own peak from here
        loads = []
        load_base = vm("VmRSS")
        rss_reset()
        for _ in range(repeat):
            DROPPED[0] = drop_cache() and DROPPED[0]
            t = time.perf_counter()
            await mgr.load(repeat, into={"model": state})
            loads.append(time.perf_counter() - t)
        load_rss = vm("VmHWM") - load_base
        load_peak = mgr._pool.peak
    return {
        "stall": statistics.median(stalls),
        "durable": statistics.median(durables),
        "staging": peak,
        "rss": rss,
        "load": statistics.median(loads),
        "load_staging": load_peak,
        "load_rss": load_rss,
    }


#: Whether the page cache could be dropped before every load (root only).
DROPPED = [True]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = ap.parse_args()
    nbytes = args.mib * MiB
    state = {f"w{i:02d}": torch.randn(nbytes // TENSORS // 4) for i in range(TENSORS)}
    where = tempfile.mkdtemp(prefix="aiockpt-cap-", dir=args.dir)
    try:
        copy, write = floors(state, where, args.repeat)
        rows = []
        for cap in (0.25, 0.5, 1.0, None):
            root = os.path.join(where, f"cap-{cap}")
            r = anyio.run(run_cap, cap, state, root, args.repeat)
            rows.append((cap, r))
            shutil.rmtree(root)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print(f"state {args.mib} MiB in {TENSORS} tensors, {args.repeat} saves each, medians")
    print(f"memcpy {copy:.3f} s, write+fsync {write:.3f} s")
    print()
    print(
        "| staging_memory | stall (s) | stall ÷ memcpy | durable (s) | durable ÷ write+fsync "
        "| staging held ÷ state | trainer peak RSS − before ÷ state |"
    )
    print("|---|---|---|---|---|---|---|")
    for cap, r in rows:
        name = "none" if cap is None else f"{cap:.0%}"
        print(
            f"| {name} | {r['stall']:.3f} | {r['stall'] / copy:.2f} | {r['durable']:.3f} | "
            f"{r['durable'] / write:.2f} | {r['staging'] / nbytes:.2f} | {r['rss'] / nbytes:.2f} |"
        )
    print()
    cache = "dropped before each" if DROPPED[0] else "not dropped (needs root)"
    print(f"load(into=state), page cache {cache}, medians")
    print()
    print(
        "| staging_memory | load (s) | load ÷ uncapped | staging held while loading ÷ state "
        "| trainer peak RSS − before ÷ state |"
    )
    print("|---|---|---|---|---|")
    uncapped = rows[-1][1]["load"]
    for cap, r in rows:
        name = "none" if cap is None else f"{cap:.0%}"
        print(
            f"| {name} | {r['load']:.3f} | {r['load'] / uncapped:.2f} | "
            f"{r['load_staging'] / nbytes:.2f} | {r['load_rss'] / nbytes:.2f} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
