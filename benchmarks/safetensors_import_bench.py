"""load_safetensors against the loaders people use today.

    python benchmarks/safetensors_import_bench.py [--mib 128] [--shards 4] [--repeats 3]
                                                  [--ranks 2 4]

Writes MIB MiB of fp32 weights (8 square layers) as a Hugging Face folder of SHARDS files and
an index, then measures, each time with the files' pages dropped from the page cache
(``posix_fadvise(DONTNEED)``, no root needed), the contenders taking turns in one run:

1. one process, into new plain tensors: ``mgr.load_safetensors(folder)`` against
   ``safetensors.torch.load_file`` of every shard (the ratio is aiockpt ÷ safetensors; one
   element of every page is then read from each result, so that a loader that maps the
   file and reads it lazily has read it too);
2. for each count of ``--ranks`` (gloo ranks on this host), into the same FSDP2 model:
   ``mgr.load_safetensors(folder, into=model)`` against ``dcp.load`` with DCP's
   ``HuggingFaceStorageReader`` (when the installed torch has it). The time is the slowest
   rank's. Bytes read ÷ bytes of the rank's own pieces: aiockpt's are its daemon's
   (``/proc/PID/io`` ``rchar``, the largest over the ranks); DCP's reader maps the files,
   so its are what the ranks fetched from the disk (``read_bytes``), summed over the ranks
   and divided by the sum of their pieces (the ranks share the page cache: a page one rank
   faulted in is not read again by another). Rank 0's aiockpt load is also cut into
   phases: the headers' request, planning, the daemon's read (its round trip included),
   the ranks' agreements, and the copy into the targets.

Medians over REPEATS, after one warm-up run of each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import anyio
import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS = 8
PHASES = ("headers", "plan", "daemon read", "agree", "copy")


def make_folder(folder: str, mib: int, shards: int) -> list[str]:
    """LAYERS square fp32 layers of MIB MiB in all, in SHARDS files plus the index."""
    side = int(((mib << 20) // LAYERS // 4) ** 0.5)
    g = torch.Generator().manual_seed(0)
    names = [f"layers.{i}.weight" for i in range(LAYERS)]
    per = -(-LAYERS // shards)
    files, weight_map = [], {}
    for s in range(shards):
        part = names[s * per : (s + 1) * per]
        if not part:
            break
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: torch.randn(side, side, generator=g) for n in part}, f"{folder}/{file}")
        files.append(f"{folder}/{file}")
        weight_map.update(dict.fromkeys(part, file))
    with open(f"{folder}/model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return files


def drop_cache(files: list[str]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def touch(tensors: dict[str, torch.Tensor]) -> None:
    """Read one element of every page of every tensor: a loader that maps the file lazily
    has then read it too."""
    for t in tensors.values():
        t.view(-1)[::1024].sum()


def io_counter(pid: int | None, field: str) -> int:
    """A counter of ``/proc/PID/io``: ``rchar`` (bytes through read syscalls) or
    ``read_bytes`` (bytes fetched from the storage layer, page faults' included)."""
    with open(f"/proc/{pid or os.getpid()}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def one_process(folder: str, files: list[str], repeats: int) -> dict[str, float]:
    from aiockpt import AsyncCheckpointManager

    times: dict[str, list[float]] = {"aiockpt": [], "other": []}

    async def main() -> None:
        async with AsyncCheckpointManager(f"{folder}/root") as mgr:
            for i in range(repeats + 1):
                drop_cache(files)
                t0 = time.perf_counter()
                got = await mgr.load_safetensors(folder)
                touch(got)
                took = time.perf_counter() - t0
                del got
                drop_cache(files)
                t0 = time.perf_counter()
                ref = {}
                for path in files:
                    ref.update(load_file(path))
                touch(ref)
                took_ref = time.perf_counter() - t0
                del ref
                if i:  # the first is a warm-up
                    times["aiockpt"].append(took)
                    times["other"].append(took_ref)

    anyio.run(main)
    return {k: statistics.median(v) for k, v in times.items()}


# --------------------------------------------------------------------------- ranks


class Phases:
    """Wall time of rank 0's aiockpt load by phase, from wrappers around the load's steps;
    what is left of the total is ``plan`` (matching names, checking shapes, the boxes)."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.runs: list[dict[str, float]] = []

    def install(self) -> None:
        from aiockpt._trainer import client, dist, hfload

        request = client.SubprocessClient.request

        async def timed_request(obj: Any, kind: Any, **fields: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await request(obj, kind, **fields)
            finally:
                key = "daemon read" if fields.get("read") is not None else "headers"
                self.now[key] += time.perf_counter() - t0

        client.SubprocessClient.request = timed_request  # type: ignore[method-assign]
        for cls, name, phase in (
            (dist.LoadAgreement, "_agree", "agree"),
            (hfload.Opened, "copy_into", "copy"),
        ):
            setattr(cls, name, self._timed(getattr(cls, name), phase))

    def _timed(self, inner: Any, phase: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.now[phase] += time.perf_counter() - t0

        return timed

    def start(self) -> None:
        self.now.clear()

    def stop(self, total: float) -> None:
        run = {k: self.now[k] for k in PHASES if k != "plan"}
        run["plan"] = total - sum(run.values())
        self.runs.append(run)

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(r[k] for r in self.runs) for k in PHASES}


def rank_main(rank: int, world: int, folder: str, repeats: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from aiockpt import AsyncCheckpointManager

    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader
    except ImportError:
        HuggingFaceStorageReader = None

    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store{world}", rank=rank, world_size=world
    )
    with open(f"{folder}/model.safetensors.index.json") as f:
        index = json.load(f)["weight_map"]
    files = sorted({f"{folder}/{f}" for f in index.values()})
    side = load_file(files[0])[next(iter(index))].shape[0]
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(
        torch.nn.Linear(side, side, bias=False) for _ in range(LAYERS)
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    needed = sum(
        p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes
        for p in model.state_dict().values()
    )
    times: dict[str, list[float]] = {"aiockpt": [], "other": []}
    read: dict[str, list[int]] = {"aiockpt": [], "other": []}
    phases = Phases()
    if rank == 0:
        phases.install()

    def start() -> float:
        if rank == 0:
            drop_cache(files)
        dist.barrier()
        return time.perf_counter()

    def slowest(t0: float) -> float:
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    async def ours(mgr: Any, i: int) -> None:
        before = io_counter(mgr.daemon_pid, "rchar")
        phases.start()
        t0 = start()
        mine = time.perf_counter()
        await mgr.load_safetensors(folder, into=model)
        mine = time.perf_counter() - mine
        took = slowest(t0)
        read["aiockpt"].append(io_counter(mgr.daemon_pid, "rchar") - before)
        if i:
            times["aiockpt"].append(took)
            phases.stop(mine)

    def theirs(i: int) -> None:
        sd = model.state_dict()
        before = io_counter(None, "read_bytes")
        t0 = start()
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(folder))
        took = slowest(t0)
        read["other"].append(io_counter(None, "read_bytes") - before)
        if i:
            times["other"].append(took)

    async def main() -> None:
        async with AsyncCheckpointManager(f"{folder}/root", process_group=dist.group.WORLD) as mgr:
            for i in range(repeats + 1):
                if i % 2 and HuggingFaceStorageReader is not None:  # taking turns at going first
                    theirs(i)
                await ours(mgr, i)
                if not i % 2 and HuggingFaceStorageReader is not None:
                    theirs(i)

    anyio.run(main)
    result: dict[str, Any] = {k: statistics.median(v) for k, v in times.items() if v}
    result["needed"] = needed
    result["read"] = {k: max(v) for k, v in read.items() if v}
    if rank == 0:
        result["phases"] = phases.medians()
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    os._exit(0)


def on_ranks(folder: str, world: int, repeats: int) -> dict[str, Any]:
    """Run ``world`` ranks; the slowest rank's medians, bytes read ÷ needed, rank 0's
    phases."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    outs = [f"{folder}/rank{r}-of-{world}.json" for r in range(world)]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"{folder}/store{world}")  # a file store is for one group only
    args = ["--world", str(world), "--folder", folder, "--repeats", str(repeats)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *args, "--rank", str(r), "--out", outs[r]], env=env
        )
        for r in range(world)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"rank exit codes {codes}")
    ranks = []
    for o in outs:
        with open(o) as f:
            ranks.append(json.load(f))
    needed = sum(r["needed"] for r in ranks)
    result = {k: ranks[0][k] for k in ("aiockpt", "other") if k in ranks[0]}
    result["read"] = max(r["read"]["aiockpt"] / r["needed"] for r in ranks)
    if "other" in ranks[0]["read"]:
        result["other_read"] = sum(r["read"]["other"] for r in ranks) / needed
    result["phases"] = ranks[0]["phases"]
    return result


def table(mib: int, shards: int, repeats: int, one: dict, ranks: dict[int, dict]) -> str:
    lines = [
        f"{mib} MiB fp32 in {shards} shards, page cache dropped, medians of {repeats}, "
        f"load average {os.getloadavg()[0]:.1f}",
        f"{'case':<34} {'aiockpt s':>9} {'other s':>9} {'ratio':>6} {'read/needed':>11} "
        f"{'other':>6}",
        f"{'1 process vs load_file':<34} {one['aiockpt']:>9.3f} {one['other']:>9.3f} "
        f"{one['aiockpt'] / one['other']:>6.2f}",
    ]
    for world, r in ranks.items():
        case = f"{world} ranks FSDP2 vs DCP HF reader"
        if "other" in r:
            other = f"{r['other']:>9.3f} {r['aiockpt'] / r['other']:>6.2f}"
            other_read = f"{r['other_read']:>6.3f}"
        else:
            other, other_read = f"{'n/a':>9} {'':>6}", f"{'n/a':>6}"
        lines.append(f"{case:<34} {r['aiockpt']:>9.3f} {other} {r['read']:>11.3f} {other_read}")
    lines.append("rank 0's aiockpt load by phase, ms:")
    lines.append(f"{'ranks':<6}" + "".join(f"{p:>12}" for p in PHASES))
    for world, r in ranks.items():
        lines.append(f"{world:<6}" + "".join(f"{r['phases'][p] * 1e3:>12.1f}" for p in PHASES))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--folder")
    p.add_argument("--out")
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world, args.folder, args.repeats, args.out)
        return
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as folder:
        files = make_folder(folder, args.mib, args.shards)
        one = one_process(folder, files, args.repeats)
        ranks = {world: on_ranks(folder, world, args.repeats) for world in args.ranks}
    print(table(args.mib, args.shards, args.repeats, one, ranks))


if __name__ == "__main__":
    main()
