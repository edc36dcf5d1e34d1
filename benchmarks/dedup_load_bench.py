"""Loading an incremental checkpoint against loading the same checkpoint saved whole.

A LoRA-like state (a frozen base, small adapters changed before each save) is saved three
times into two roots, with deduplication (step 3 reads the base from step 1's file) and
without (step 3 is one file). Step 3 is then loaded from each root in turn, the page cache
dropped before each load, and the times and bytes read are printed side by side:

    python benchmarks/dedup_load_bench.py --base-mib 1024 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import anyio
import torch

from aiockpt import AsyncCheckpointManager


def drop_cache() -> bool:
    """Drop the page cache (root only); whether it was dropped."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def state(base_mib: int) -> dict:
    n = base_mib // 16  # 16 MiB frozen weights, each followed by its adapters
    g = torch.Generator().manual_seed(0)
    model = {}
    for i in range(n):
        model[f"layers.{i}.weight"] = torch.randn(2048, 2048, generator=g)
        model[f"layers.{i}.lora_a"] = torch.zeros(16, 2048)
        model[f"layers.{i}.lora_b"] = torch.zeros(2048, 16)
    return {"model": model}


async def save(root: str, st: dict, dedup: bool) -> None:
    async with AsyncCheckpointManager(root, dedup=dedup) as mgr:
        for step in (1, 2, 3):
            for name, t in st["model"].items():
                if "lora" in name:
                    t += 1.0
            await (await mgr.save(step, st))


async def load(root: str, into: dict | None) -> tuple[float, int]:
    read = []
    async with AsyncCheckpointManager(
        root, read_only=True, event_handlers=[lambda e: e.name == "load.end" and read.append(e)]
    ) as mgr:
        drop_cache()
        t0 = time.perf_counter()
        await mgr.load(3, into=into)
        elapsed = time.perf_counter() - t0
    return elapsed, read[-1].read_nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the roots go (default: a temp dir)")
    args = p.parse_args()
    work = tempfile.mkdtemp(dir=args.dir, prefix="dedup-load-")
    try:
        st = state(args.base_mib)
        roots = {"incremental": os.path.join(work, "inc"), "whole": os.path.join(work, "whole")}
        anyio.run(save, roots["incremental"], st, True)
        anyio.run(save, roots["whole"], st, False)
        if not drop_cache():
            print("(page cache not dropped: run as root for cold loads)")
        times: dict[str, dict[str, list[float]]] = {
            kind: {"load()": [], "load(into=)": []} for kind in roots
        }
        read: dict[str, int] = {}
        for _ in range(args.repeats):  # alternating, so drift hits both alike
            for kind, root in roots.items():
                t, n = anyio.run(load, root, None)
                times[kind]["load()"].append(t)
                t, n = anyio.run(load, root, st)
                times[kind]["load(into=)"].append(t)
                read[kind] = n
        print(f"step 3 of {args.base_mib} MiB frozen + adapters, medians of {args.repeats}, cold")
        print(f"{'root':<12} {'load()':>10} {'load(into=)':>12} {'read':>12}")
        for kind in roots:
            a = statistics.median(times[kind]["load()"])
            b = statistics.median(times[kind]["load(into=)"])
            print(f"{kind:<12} {a:>9.3f}s {b:>11.3f}s {read[kind] / 2**20:>9.1f} MiB")
        for col in ("load()", "load(into=)"):
            ratio = statistics.median(times["incremental"][col]) / statistics.median(
                times["whole"][col]
            )
            print(f"incremental ÷ whole, {col}: {ratio:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
