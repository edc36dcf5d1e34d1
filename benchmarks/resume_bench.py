"""What a restarted run pays: the first load and the first save of a fresh process.

A job resumed after preemption opens a manager in a new process, loads the latest checkpoint
into the state it has just built, and goes on saving. That process has no staging slab yet:
its first load and its first save each make one, and fresh memory costs a page fault per
page, which on a virtual machine can cost more than the read itself. This benchmark runs each
repeat in a fresh interpreter: open a manager, ``load(into=state)`` twice (page cache dropped
before each), then save twice, timing each; the table shows medians over the repeats, the
first of each against the later one, and the floor of making fresh shared memory of the
state's size both ways (``MAP_POPULATE``, and touching each page from the process).

    python benchmarks/resume_bench.py [--scenarios 1g,20k] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

#: key: (label, tensors, float32 elements per tensor)
SCENARIOS = {
    "1g": ("1 GiB / 64 tensors", 64, (1 << 30) // 64 // 4),
    "20k": ("256 MiB / 20k tensors", 20_000, (256 << 20) // 20_000 // 4),
}

#: One repeat: prints one JSON object of seconds.
CHILD = r"""
import json, mmap, os, sys, time, _posixshmem
import anyio, torch
from aiockpt import AsyncCheckpointManager
from dedup_load_bench import drop_cache

n, numel, root, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]

def fresh_memory(size, populate):
    name = f"/aiockpt-bench-{os.getpid()}-{int(populate)}"
    fd = _posixshmem.shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode=0o600)
    try:
        os.ftruncate(fd, size)
        t0 = time.perf_counter()
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        mm = mmap.mmap(fd, size, flags=flags)
        if not populate:
            torch.frombuffer(mm, dtype=torch.uint8).zero_()
        took = time.perf_counter() - t0
        mm.close()
    finally:
        os.close(fd)
        _posixshmem.shm_unlink(name)
    return took

async def main():
    state = {"model": {f"layer{i}.weight": torch.randn(numel) for i in range(n)}}
    if mode == "make":
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(0, state))
        return
    if mode == "memory":
        size = n * numel * 4
        took = {"populate_s": fresh_memory(size, True), "touch_s": fresh_memory(size, False)}
        print(json.dumps(took))
        return
    out = {}
    async with AsyncCheckpointManager(root) as mgr:
        for i in range(2):
            drop_cache()
            t0 = time.perf_counter()
            await mgr.load(0, into=state)
            out[f"load{i}"] = time.perf_counter() - t0
        for i in range(2):
            for t in state["model"].values():
                t.add_(1)
            t0 = time.perf_counter()
            handle = await mgr.save(i + 1, state)
            out[f"stall{i}"] = time.perf_counter() - t0
            await handle
    print(json.dumps(out))

anyio.run(main)
"""


def child(args: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=HERE)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, check=True
    )
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scenarios", default="1g,20k")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    a = p.parse_args()
    print(
        "| state | first load(into) | later load(into) | first save: stall | later save: stall "
        "| fresh memory: MAP_POPULATE | touched |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key in a.scenarios.split(","):
        label, n, numel = SCENARIOS[key]
        runs: list[dict[str, float]] = []
        with tempfile.TemporaryDirectory(dir=a.dir) as d:
            root = os.path.join(d, "ckpt")
            child([str(n), str(numel), root, "make"])
            for _ in range(a.repeats):
                runs.append(child([str(n), str(numel), root, "resume"]))
                runs[-1].update(child([str(n), str(numel), root, "memory"]))
                # only step 0 stays: every repeat saves steps 1 and 2 again
                for step in (1, 2):
                    shutil.rmtree(os.path.join(root, f"step_{step:012d}"))
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {label} | {ms(med['load0'])} | {ms(med['load1'])} | {ms(med['stall0'])} "
            f"| {ms(med['stall1'])} | {ms(med['populate_s'])} | {ms(med['touch_s'])} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
