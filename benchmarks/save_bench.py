"""How long a save stalls the trainer and how soon it is durable, against the floors.

For each scenario, after one warm-up save, in one run:

- stall: ``await mgr.save`` ÷ one memcpy of the same bytes into a preallocated buffer;
- durable: save-to-committed ÷ a plain buffered write + fsync of the same bytes, same directory;
- trainer CPU share: ``time.thread_time()`` ÷ wall time of the trainer thread while it runs a
  pure-Python loop during the in-flight save (waiting for the GIL lowers it), and the loop's
  rate against an idle window.

    python benchmarks/save_bench.py [--scenarios 1g,20k,20k2d,256m] [--repeats 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time

import anyio
import torch
from compare import spin  # the same stand-in for training work as the comparison

from aiockpt import AsyncCheckpointManager

#: key: (label, tensors, shape of each float32 tensor)
SCENARIOS = {
    "1g": ("1 GiB / 64 tensors", 64, ((1 << 30) // 64 // 4,)),
    "20k": ("256 MiB / 20k tensors", 20_000, ((256 << 20) // 20_000 // 4,)),
    # For information: 2-D tensors, copied as rows by torch.cat with a full shape check.
    "20k2d": ("256 MiB / 20k 2-D tensors", 20_000, (5, (256 << 20) // 20_000 // 4 // 5)),
    "256m": ("256 MiB / 64 tensors", 64, ((256 << 20) // 64 // 4,)),
}


def make_state(n: int, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    return {f"layer{i:05d}.weight": torch.randn(shape) for i in range(n)}


def memcpy_time(nbytes: int, repeats: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return min(times)


def write_fsync_time(nbytes: int, directory: str, repeats: int) -> float:
    data = memoryview(torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy())
    times = []
    for i in range(repeats):
        path = os.path.join(directory, f"raw-{i}.bin")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - t0)
        os.unlink(path)
    return min(times)


async def measure(mgr: AsyncCheckpointManager, step: int, state: dict) -> dict[str, float]:
    t0 = time.perf_counter()
    handle = await mgr.save(step, state)
    stall = time.perf_counter() - t0
    cpu0, wall0, iters = time.thread_time(), time.perf_counter(), 0
    while not handle.done():
        iters += spin(0.002)
        await anyio.sleep(0)  # lets the manager's reader see the commit
    await handle
    durable = time.perf_counter() - t0
    wall = time.perf_counter() - wall0
    cpu = time.thread_time() - cpu0
    return {"stall": stall, "durable": durable, "cpu_share": cpu / wall, "rate": iters / wall}


async def run(scenarios: list[str], repeats: int, directory: str) -> None:
    idle = spin(0.5) / 0.5
    rows = []
    for key in scenarios:
        label, n, shape = SCENARIOS[key]
        state = make_state(n, shape)
        nbytes = n * math.prod(shape) * 4
        memcpy = memcpy_time(nbytes, repeats)
        raw = write_fsync_time(nbytes, directory, max(2, repeats // 2))
        root = os.path.join(directory, f"run-{key}")
        results = []
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(0, state))  # warm-up: slab allocated, layout cached
            for step in range(1, repeats + 1):
                results.append(await measure(mgr, step, state))
                for t in state.values():  # the trainer moves on
                    t.add_(1.0)
        best = {k: min(r[k] for r in results) for k in ("stall", "durable")}
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        rows.append((label, memcpy, raw, best, med, idle))
        shutil.rmtree(root, ignore_errors=True)
    header = ("scenario", "memcpy s", "stall s", "stall/memcpy", "write+fsync s", "durable s")
    header += ("durable/raw", "cpu share", "loop rate")
    widths = (28, 9, 9, 13, 14, 10, 12, 10, 10)
    print(
        "\n"
        + "".join(
            f"{h:<{w}}" if i == 0 else f"{h:>{w}}"
            for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    )
    for label, memcpy, raw, best, med, idle in rows:
        print(
            f"{label:<28}{memcpy:>9.3f}{med['stall']:>9.3f}"
            f"{med['stall'] / memcpy:>7.2f} ({best['stall'] / memcpy:.2f})"
            f"{raw:>14.3f}{med['durable']:>10.3f}"
            f"{med['durable'] / raw:>6.2f} ({best['durable'] / raw:.2f})"
            f"{med['cpu_share']:>10.3f}{med['rate'] / idle:>10.2f}"
        )
    print(
        "\nmedians over the repeats, best in parentheses; loop rate is relative to an idle window"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scenarios", default="1g,20k")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--dir", default=None, help="where to write (default: a temporary directory here)"
    )
    args = p.parse_args()
    keys = args.scenarios.split(",")
    for k in keys:
        if k not in SCENARIOS:
            p.error(f"unknown scenario {k!r}; choose from {', '.join(SCENARIOS)}")
    with tempfile.TemporaryDirectory(dir=args.dir or ".") as d:
        anyio.run(run, keys, args.repeats, d)


if __name__ == "__main__":
    main()
