"""`load(into=state)` atomic (the default) against streamed (`atomic=False`), with and without
a staging-memory cap.

An atomic load changes the target only once every checksum has passed, so its copy into the
target follows the read, and under ``staging_memory`` it reads the shard twice (checked whole
first, then copied window by window). A streamed load reads each window once, checks it as it
is read and copies it while the next is read. Each scenario's state is saved once, then
loaded into itself by a manager per cap, the two kinds taking turns with a raw read of the
shard file (the floor), the page cache dropped before each; medians:

    python benchmarks/streamed_load_bench.py --scenarios 1g,20k --caps none,0.5,0.25 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import anyio
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import raw_read
from dedup_load_bench import drop_cache

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt

MiB = 1 << 20
SCENARIOS = {"1g": (64, 1024 * MiB), "20k": (20_000, 256 * MiB)}


async def run(tensors: int, nbytes: int, caps: list[float | None], repeats: int, root: str):
    numel = nbytes // tensors // 4
    state = {f"t{i:05d}": torch.randn(numel) for i in range(tensors)}
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state))
    shard = os.path.join(root, fmt.step_dirname(1), fmt.shard_filename(0))
    size = os.path.getsize(shard)
    buf = torch.zeros(size, dtype=torch.uint8)
    rows = []
    for cap in caps:
        staging = None if cap is None else int(cap * size)
        times: dict[str, list[float]] = {"raw": [], "atomic": [], "streamed": []}
        async with AsyncCheckpointManager(root, staging_memory=staging, read_only=True) as mgr:
            for atomic in (True, False):  # warm: the manifest parsed, the slabs made
                await mgr.load(1, into=state, atomic=atomic)
            for i in range(repeats):
                drop_cache()
                t0 = time.perf_counter()
                raw_read(shard, buf)
                times["raw"].append(time.perf_counter() - t0)
                for kind in ("atomic", "streamed") if i % 2 else ("streamed", "atomic"):
                    drop_cache()
                    t0 = time.perf_counter()
                    await mgr.load(1, into=state, atomic=kind == "atomic")
                    times[kind].append(time.perf_counter() - t0)
        rows.append((cap, {k: statistics.median(v) for k, v in times.items()}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="1g,20k", help=f"of {','.join(SCENARIOS)}")
    parser.add_argument("--caps", default="none,0.5,0.25", help="fractions of the shard")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    caps = [None if c == "none" else float(c) for c in args.caps.split(",")]
    if not drop_cache():
        print("warning: not root, the page cache is not dropped before each load")
    print(f"load(into=state), medians of {args.repeats}, page cache dropped before each")
    print("| state | staging_memory | raw read | atomic | ÷ raw | streamed | ÷ raw | ÷ atomic |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for key in args.scenarios.split(","):
        tensors, nbytes = SCENARIOS[key]
        with tempfile.TemporaryDirectory(prefix="aiockpt-streamed-") as root:
            rows = anyio.run(run, tensors, nbytes, caps, args.repeats, root)
        for cap, m in rows:
            print(
                f"| {nbytes // MiB} MiB / {tensors} tensors "
                f"| {'none' if cap is None else f'{cap:.0%}'} | {m['raw'] * 1e3:.0f} ms "
                f"| {m['atomic'] * 1e3:.0f} ms | {m['atomic'] / m['raw']:.2f} "
                f"| {m['streamed'] * 1e3:.0f} ms | {m['streamed'] / m['raw']:.2f} "
                f"| {m['streamed'] / m['atomic']:.2f} |"
            )


if __name__ == "__main__":
    main()
