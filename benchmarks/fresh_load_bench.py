"""`load()` (new tensors) against its floor and against `torch.load`, in one run.

Each scenario's state is saved once by aiockpt and once by `torch.save`; then, taking turns:
a raw read of the aiockpt shard into new tensors (one `torch.empty` per tensor, one
`os.preadv` into each, one thread: the floor of a load that returns new tensors),
`torch.load` of the `torch.save` file, and aiockpt's `load()`. Medians and bests, with the
page cache warm (default) or dropped before each load (``--drop``, as root):

    python benchmarks/fresh_load_bench.py --scenarios 1g,20k --repeats 5 [--drop]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import anyio
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dedup_load_bench import drop_cache

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt
from aiockpt._trainer.state import ST_TO_TORCH

MiB = 1 << 20
SCENARIOS = {"1g": (64, 1024 * MiB), "20k": (20_000, 256 * MiB)}


def raw_new_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``, each read by ``os.preadv`` into a new
    tensor of its dtype and shape."""
    out = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        header = json.loads(os.pread(fd, n, 8))
        header.pop("__metadata__", None)
        for name, h in header.items():
            t = torch.empty(h["shape"], dtype=ST_TO_TORCH[h["dtype"]])
            lo, hi = h["data_offsets"]
            mv = t.view(-1).view(torch.uint8).numpy().data.cast("B")
            done = 0
            while done < hi - lo:
                done += os.preadv(fd, [mv[done:]], 8 + n + lo + done)
            out[name] = t
    finally:
        os.close(fd)
    return out


async def run(tensors: int, nbytes: int, repeats: int, drop: bool, root: str) -> dict:
    numel = nbytes // tensors // 4
    state = {f"t{i:05d}": torch.randn(numel) for i in range(tensors)}
    pt = os.path.join(root, "state.pt")
    torch.save(state, pt)
    async with AsyncCheckpointManager(os.path.join(root, "run")) as mgr:
        await (await mgr.save(1, state))
    del state
    step_dir = os.path.join(root, "run", fmt.step_dirname(1))
    (name,) = [n for n in os.listdir(step_dir) if n.startswith("shard_r00000")]
    shard = os.path.join(step_dir, name)
    times: dict[str, list[float]] = {"raw": [], "torch.load": [], "load()": []}
    async with AsyncCheckpointManager(os.path.join(root, "run"), read_only=True) as mgr:
        await mgr.load(1)  # warm: the daemon started, the manifest parsed

        async def aio() -> Any:
            return await mgr.load(1)

        kinds: dict[str, Callable[[], Any]] = {
            "raw": lambda: raw_new_tensors(shard),
            "torch.load": lambda: torch.load(pt, weights_only=True),
        }
        for i in range(repeats):
            order = ["raw", "torch.load", "load()"]
            for kind in order if i % 2 == 0 else order[::-1]:
                if drop:
                    drop_cache()
                t0 = time.perf_counter()
                got = await aio() if kind == "load()" else kinds[kind]()
                times[kind].append(time.perf_counter() - t0)
                del got
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="1g", help=f"of {','.join(SCENARIOS)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--drop", action="store_true", help="drop the page cache before each")
    args = parser.parse_args()
    if args.drop and not drop_cache():
        print("warning: not root, the page cache is not dropped before each load")
    cache = "dropped" if args.drop else "warm"
    print(f"new tensors from a local root, page cache {cache}, median (best) of {args.repeats}")
    print("| state | raw preadv | torch.load | load() | ÷ raw | ÷ torch.load |")
    print("|---|---:|---:|---:|---:|---:|")
    for key in args.scenarios.split(","):
        tensors, nbytes = SCENARIOS[key]
        with tempfile.TemporaryDirectory(prefix="aiockpt-fresh-") as root:
            t = anyio.run(run, tensors, nbytes, args.repeats, args.drop, root)
        med = {k: statistics.median(v) for k, v in t.items()}
        best = {k: min(v) for k, v in t.items()}
        print(
            f"| {nbytes // MiB} MiB / {tensors} tensors "
            + "".join(f"| {med[k] * 1e3:.0f} ({best[k] * 1e3:.0f}) ms " for k in t)
            + f"| {med['load()'] / med['raw']:.2f} "
            + f"| {med['load()'] / med['torch.load']:.2f} |"
        )


if __name__ == "__main__":
    main()
