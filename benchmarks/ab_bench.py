"""Two versions of aiockpt side by side: save stall, time to durable, and load times.

For a change that must not cost speed (a refactor, say): check the other version out beside
this one, then run both here, alternating, in one run, so both see the same machine:

    git worktree add ../aiockpt-base <commit>
    python benchmarks/ab_bench.py --base ../aiockpt-base [--scenarios 1g,20k] [--repeats 5]

Each repeat runs each version in a fresh interpreter (its own daemon, importing aiockpt from its
tree through the public API only), which saves a warm-up step, then ``--saves`` more, measuring
each save's stall (``await mgr.save``) and its time to committed, then ``load()`` into fresh
tensors and ``load(into=state)`` twice each; it reports its medians. The table shows the
median over repeats and the ratio this tree ÷ base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: key: (label, tensors, float32 elements per tensor)
SCENARIOS = {
    "1g": ("1 GiB / 64 tensors", 64, (1 << 30) // 64 // 4),
    "20k": ("256 MiB / 20k tensors", 20_000, (256 << 20) // 20_000 // 4),
    "256m": ("256 MiB / 64 tensors", 64, (256 << 20) // 64 // 4),
}
METRICS = ("stall_s", "durable_s", "load_s", "load_into_s")

#: What each version runs: prints one JSON object of seconds.
CHILD = r"""
import json, statistics, sys, time
import anyio, torch
from aiockpt import AsyncCheckpointManager

n, numel, saves, root = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

async def main():
    state = {"model": {f"layer{i}.weight": torch.randn(numel) for i in range(n)}}
    stalls, durables, loads, loads_into = [], [], [], []
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))  # warm-up: slabs, layouts, the daemon's caches
        for step in range(1, saves + 1):
            for t in state["model"].values():
                t.add_(1)
            t0 = time.perf_counter()
            handle = await mgr.save(step, state)
            t1 = time.perf_counter()
            await handle
            t2 = time.perf_counter()
            stalls.append(t1 - t0)
            durables.append(t2 - t0)
        for _ in range(2):
            t0 = time.perf_counter()
            await mgr.load(saves)
            t1 = time.perf_counter()
            await mgr.load(saves, into=state)
            t2 = time.perf_counter()
            loads.append(t1 - t0)
            loads_into.append(t2 - t1)
    med = statistics.median
    print(json.dumps({"stall_s": med(stalls), "durable_s": med(durables),
                      "load_s": med(loads), "load_into_s": med(loads_into)}))

anyio.run(main)
"""


def run_once(tree: str, n: int, numel: int, saves: int, directory: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=directory) as root:
        env = {**os.environ, "PYTHONPATH": tree}
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(n), str(numel), str(saves), f"{root}/run"],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"the run in {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="a checkout of the version to compare to")
    parser.add_argument("--scenarios", default="1g,20k")
    parser.add_argument("--repeats", type=int, default=5, help="processes per version")
    parser.add_argument("--saves", type=int, default=4, help="saves per process (median)")
    parser.add_argument("--dir", default=None, help="where checkpoints are written")
    args = parser.parse_args()
    trees = {"this": HERE, "base": os.path.abspath(args.base)}
    directory = args.dir or tempfile.gettempdir()
    print(f"{'scenario':<24} {'metric':<12} {'base ms':>9} {'this ms':>9} {'this/base':>9}")
    for key in args.scenarios.split(","):
        label, n, numel = SCENARIOS[key]
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for i in range(args.repeats):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))  # alternate who goes first
            for name in order:
                runs[name].append(run_once(trees[name], n, numel, args.saves, directory))
        for metric in METRICS:
            base = statistics.median(r[metric] for r in runs["base"])
            this = statistics.median(r[metric] for r in runs["this"])
            print(
                f"{label:<24} {metric:<12} {base * 1e3:9.1f} {this * 1e3:9.1f} {this / base:9.2f}"
            )


if __name__ == "__main__":
    main()
