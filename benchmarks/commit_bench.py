"""A multi-rank commit's cost as the number of ranks grows: storage requests and latency.

N simulated ranks are threads running the daemons' own commit code (Coordinator and its
rendezvous) over one counting local storage. Each writes a small shard and hands rank 0 its
part (64 tensor entries); the last rank's shard lands ``--late`` seconds after the others'.
Both ways of signalling run side by side:

- ``storage``: part files, rank 0 listing the step directory and the others checking for its
  marker, each with backoff up to 0.1 s (the only way before the store, now the fallback);
- ``store``: keys of a c10d store (an in-process HashStore: one process cannot hold 1,024
  TCPStore connections reliably), through the trainer's own store operations.

Printed: storage requests per save (all ranks, and the most any rank made), and the commit
latency, from the last shard landing to the manifest written.

    python benchmarks/commit_bench.py [--ranks 2,16,256,1024] [--late 2.0] [--tensors 64]
                                      [--plot docs/commit.png]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import threading
import time

import torch.distributed as dist

from aiockpt._core import format as fmt
from aiockpt._daemon.coord import Coordinator, Part
from aiockpt._daemon.rendezvous import StorageRendezvous, StoreRendezvous
from aiockpt._trainer.storeproxy import TorchStoreOps
from aiockpt.storage import CountingStorage, LocalStorage


def make_part(rank: int, n_tensors: int) -> Part:
    specs, pos = [], 0
    for i in range(n_tensors):
        specs.append(fmt.TensorSpec(f"layers/{i}/weight", "F32", (256, 256), pos, pos + 262144))
        pos += 262144
    tensors = fmt.tensors_json(specs, 4096, [rank * 1000 + i for i in range(n_tensors)])
    tree = json.dumps({"D": [[s.name, {"T": s.name}] for s in specs]}, separators=(",", ":"))
    shard = {"file": fmt.shard_filename(rank), "rank": rank, "nbytes": 4096 + pos, "crc32c": rank}
    return Part(rank, shard, tensors, tree)


def one_save(signals: str, ranks: int, n_tensors: int, late: float, root: str) -> dict:
    storage = CountingStorage(LocalStorage(root))
    store = dist.HashStore()
    timeout = 120.0

    def via(r: int):
        if signals == "store":
            return StoreRendezvous(TorchStoreOps(store), storage, r, ranks, timeout)
        return StorageRendezvous(storage, r, ranks, timeout)

    coords = [Coordinator(storage, r, ranks, timeout, via=via(r)) for r in range(ranks)]
    parts = [make_part(r, n_tensors) for r in range(ranks)]
    step, uuid = 1, "bench"
    step_dir = fmt.step_dirname(step)
    landed = [0.0] * ranks
    committed = [0.0]
    counts: list[dict[str, int]] = [{} for _ in range(ranks)]
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        with storage.scope() as c:
            try:
                if r == ranks - 1:
                    time.sleep(late)
                storage.makedirs(step_dir)
                storage.write_file(f"{step_dir}/{fmt.shard_filename(r)}", [b"\0" * 64])
                landed[r] = time.monotonic()
                coords[r].commit(step=step, uuid=uuid, part=parts[r], metrics={}, metadata={})
                if r == 0:
                    committed[0] = time.monotonic()
                    coords[0].finished(step, uuid)
            except BaseException as e:
                errors.append(e)
        counts[r] = dict(c)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    per_rank = [sum(c.values()) for c in counts]
    return {
        "signals": signals,
        "ranks": ranks,
        "requests": sum(per_rank),
        "max_per_rank": max(per_rank),
        "rank0": per_rank[0],
        "latency_s": committed[0] - max(landed),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", default="2,16,256,1024")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--late", type=float, default=2.0)
    p.add_argument("--plot", help="write a plot of both columns against the ranks here")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    rows = []
    for ranks in [int(r) for r in args.ranks.split(",")]:
        for signals in ("storage", "store"):
            with tempfile.TemporaryDirectory() as root:
                rows.append(one_save(signals, ranks, args.tensors, args.late, root))
    print(f"the last rank's shard lands {args.late} s after the others'; {args.tensors} tensors")
    print(
        f"{'ranks':>6} {'signals':>8} {'requests':>9} {'max/rank':>9} {'rank 0':>7} "
        f"{'latency s':>10}"
    )
    for r in rows:
        print(
            f"{r['ranks']:>6} {r['signals']:>8} {r['requests']:>9} {r['max_per_rank']:>9} "
            f"{r['rank0']:>7} {r['latency_s']:>10.3f}"
        )
    if args.plot:
        plot(rows, args.late, args.plot)
        print(f"wrote {args.plot}")


def plot(rows: list[dict], late: float, path: str) -> None:
    """Requests per save and commit latency against the ranks, both ways, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for signals, style in (("storage", "o--"), ("store", "s-")):
        mine = [r for r in rows if r["signals"] == signals]
        ranks = [r["ranks"] for r in mine]
        left.plot(ranks, [r["requests"] for r in mine], style, label=f"{signals} signals")
        right.plot(ranks, [r["latency_s"] for r in mine], style, label=f"{signals} signals")
    left.set(title="storage requests per save", xlabel="ranks", xscale="log", yscale="log")
    right.set(
        title="last shard landed -> committed (s)", xlabel="ranks", xscale="log", yscale="log"
    )
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"one multi-rank save, the last rank {late:g} s late")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
