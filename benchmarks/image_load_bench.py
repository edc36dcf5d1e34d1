"""`load(into=state)` read as the file's image, against the same load told every tensor's place.

A run that loads into the state it saves lends the daemon a slab whose views of that state's
layout are already made; when the shard's head is that layout's header the daemon reads the
tensors where the file has them and the trainer restores from those views (``LoadReq.image``,
see docs/design.md, "Loading"). This saves ``--steps`` steps of ``--tensors`` tensors, then
loads the last one into the state in one process, alternating a load read as the image with
one whose request leaves the image out (so the daemon sends every tensor's place), and a raw
read of the shard file, the page cache dropped before each:

    python benchmarks/image_load_bench.py --tensors 20000 --mib 256 --repeats 16
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
from aiockpt._trainer import staging


async def run(args: argparse.Namespace, root: str) -> dict[str, list[float]]:
    numel = (args.mib << 20) // args.tensors // 4
    state = {f"t{i:05d}": torch.randn(numel) for i in range(args.tensors)}
    with_image = staging.Layout.image
    # The same request with an image no shard matches: the daemon answers with every place.
    without = property(lambda self: (0, b""))
    times: dict[str, list[float]] = {"raw read": [], "image": [], "every place": []}
    async with AsyncCheckpointManager(root) as mgr:
        for step in range(1, args.steps + 1):
            for t in state.values():
                t.add_(1.0)  # nothing repeats: each step's shard holds its own bytes
            await (await mgr.save(step, state))
        shard = os.path.join(root, fmt.step_dirname(args.steps), fmt.shard_filename(0))
        buf = torch.zeros(os.path.getsize(shard), dtype=torch.uint8)
        await mgr.load(args.steps, into=state)  # warm: the manifest parsed, the slab made
        try:
            for i in range(args.repeats):
                drop_cache()
                t0 = time.perf_counter()
                raw_read(shard, buf)
                times["raw read"].append(time.perf_counter() - t0)
                kinds = ("image", "every place") if i % 2 else ("every place", "image")
                for kind in kinds:
                    staging.Layout.image = with_image if kind == "image" else without  # type: ignore[method-assign]
                    drop_cache()
                    t0 = time.perf_counter()
                    await mgr.load(args.steps, into=state)
                    times[kind].append(time.perf_counter() - t0)
        finally:
            staging.Layout.image = with_image  # type: ignore[method-assign]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=20_000)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1, help="saved before the loads")
    parser.add_argument("--repeats", type=int, default=16)
    args = parser.parse_args()
    if not drop_cache():
        print("warning: not root, the page cache is not dropped before each load")
    with tempfile.TemporaryDirectory(prefix="aiockpt-image-") as root:
        times = anyio.run(run, args, root)
    raw = statistics.median(times["raw read"])
    print(f"{args.tensors} tensors, {args.mib} MiB, load(into=state), medians of {args.repeats}")
    print("| load | median | ÷ raw read |")
    print("|---|---:|---:|")
    for kind, ts in times.items():
        m = statistics.median(ts)
        print(f"| {kind} | {m * 1e3:.0f} ms | {m / raw:.2f} |")


if __name__ == "__main__":
    main()
