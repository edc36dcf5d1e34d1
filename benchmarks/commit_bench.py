"""The multi-rank commit's cost as the number of ranks grows.

Rank 0's daemon commits by listing the step directory, reading every other rank's part file,
splicing them into the manifest and writing it. Here the parts of N ranks (64 tensors each)
are written up front in one process, then rank 0's real commit path runs on a local directory
and is timed. Target: linear in ranks and under 1 s at 1024 ranks.

    python benchmarks/commit_bench.py [--ranks 1,8,64,256,1024] [--tensors 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from aiockpt._core import format as fmt
from aiockpt._daemon.coord import Coordinator, Part, part_name
from aiockpt.storage import LocalStorage


def make_part(rank: int, n_tensors: int) -> Part:
    specs, pos = [], 0
    for i in range(n_tensors):
        specs.append(fmt.TensorSpec(f"layers/{i}/weight", "F32", (256, 256), pos, pos + 262144))
        pos += 262144
    tensors = fmt.tensors_json(specs, 4096, [rank * 1000 + i for i in range(n_tensors)])
    tree = json.dumps({"D": [[s.name, {"T": s.name}] for s in specs]}, separators=(",", ":"))
    shard = {"file": fmt.shard_filename(rank), "rank": rank, "nbytes": 4096 + pos, "crc32c": rank}
    return Part(rank, shard, tensors, tree)


def commit_once(ranks: int, n_tensors: int, root: str, step: int) -> tuple[float, int]:
    storage = LocalStorage(root)
    step_dir = fmt.step_dirname(step)
    storage.makedirs(step_dir)
    uuid = f"bench{step}"
    for r in range(1, ranks):
        storage.put_atomic(f"{step_dir}/{part_name(uuid, r)}", make_part(r, n_tensors).encode())
    own = make_part(0, n_tensors)
    coord = Coordinator(storage, 0, ranks, timeout=60)
    t0 = time.perf_counter()
    coord.commit(step=step, uuid=uuid, part=own, metrics={"loss": 1.0}, metadata={})
    elapsed = time.perf_counter() - t0
    return elapsed, storage.size(f"{step_dir}/{fmt.MANIFEST}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", default="1,8,64,256,1024")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        step = 0
        for ranks in [int(r) for r in args.ranks.split(",")]:
            times = []
            for _ in range(args.repeats):
                step += 1
                t, size = commit_once(ranks, args.tensors, root, step)
                times.append(t)
            rows.append((ranks, statistics.median(times), size))
    print(f"{'ranks':>6} {'commit s':>10} {'per rank us':>12} {'manifest MiB':>13}")
    for ranks, t, size in rows:
        print(f"{ranks:>6} {t:>10.4f} {t / ranks * 1e6:>12.1f} {size / 2**20:>13.2f}")
    # Compare per-rank cost against the smallest run past the fixed costs of one rank.
    first, last = rows[1] if len(rows) > 2 else rows[0], rows[-1]
    if last[0] > first[0]:
        growth = (last[1] / last[0]) / (first[1] / first[0])
        print(f"per-rank cost at {last[0]} ranks / at {first[0]}: {growth:.2f}x (1.0 = linear)")


if __name__ == "__main__":
    main()
