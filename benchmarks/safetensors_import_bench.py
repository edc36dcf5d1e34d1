"""load_safetensors against the loaders people use today.

    python benchmarks/safetensors_import_bench.py [--mib 128] [--shards 4] [--repeats 3]

Writes MIB MiB of fp32 weights (8 square layers) as a Hugging Face folder of SHARDS files and
an index, then measures, each time with the files' pages dropped from the page cache
(``posix_fadvise(DONTNEED)``, no root needed):

1. one process, into new plain tensors: ``mgr.load_safetensors(folder)`` against
   ``safetensors.torch.load_file`` of every shard (the ratio is aiockpt ÷ safetensors; one
   element of every page is then read from each result, so that a loader that maps the
   file and reads it lazily has read it too);
2. on 2 gloo ranks, into the same FSDP2 model: ``mgr.load_safetensors(folder, into=model)``
   against ``dcp.load`` with DCP's ``HuggingFaceStorageReader`` (when the installed torch has
   it). The time is the slowest rank's; aiockpt's bytes read per rank are its daemon's
   (``/proc/PID/io`` rchar), divided by the bytes of the rank's own pieces.

Medians over REPEATS, after one warm-up run of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import anyio
import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS = 8


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


def one_process(folder: str, files: list[str], repeats: int) -> dict[str, float]:
    from aiockpt import AsyncCheckpointManager

    times: dict[str, list[float]] = {"aiockpt": [], "safetensors": []}

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
                    times["safetensors"].append(took_ref)

    anyio.run(main)
    return {k: statistics.median(v) for k, v in times.items()}


# --------------------------------------------------------------------------- 2 ranks


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
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world
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
    times: dict[str, list[float]] = {"aiockpt": [], "dcp": []}
    ratio: list[float] = []

    def start() -> float:
        if rank == 0:
            drop_cache(files)
        dist.barrier()
        return time.perf_counter()

    def slowest(t0: float) -> float:
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    async def main() -> None:
        async with AsyncCheckpointManager(f"{folder}/root", process_group=dist.group.WORLD) as mgr:
            for i in range(repeats + 1):
                before = rchar(mgr.daemon_pid)
                t0 = start()
                await mgr.load_safetensors(folder, into=model)
                took = slowest(t0)
                ratio.append((rchar(mgr.daemon_pid) - before) / needed)
                if i:
                    times["aiockpt"].append(took)
                if HuggingFaceStorageReader is not None:
                    sd = model.state_dict()
                    t0 = start()
                    dcp.load(sd, storage_reader=HuggingFaceStorageReader(folder))
                    took = slowest(t0)
                    if i:
                        times["dcp"].append(took)

    anyio.run(main)
    result = {k: statistics.median(v) for k, v in times.items() if v}
    result["read_ratio"] = max(ratio)
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    os._exit(0)


def rchar(pid: int | None) -> int:
    """Bytes process ``pid`` read through read syscalls (its daemon's reads)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def two_ranks(folder: str, repeats: int) -> list[dict]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    outs = [f"{folder}/rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--rank",
                str(r),
                "--folder",
                folder,
                "--out",
                outs[r],
                "--repeats",
                str(repeats),
            ],
            env=env,
        )
        for r in range(2)
    ]
    codes = [p.wait() for p in procs]
    if codes != [0, 0]:
        raise SystemExit(f"rank exit codes {codes}")
    results = []
    for o in outs:
        with open(o) as f:
            results.append(json.load(f))
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rank", type=int)
    p.add_argument("--folder")
    p.add_argument("--out")
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args.rank, 2, args.folder, args.repeats, args.out)
        return
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as folder:
        files = make_folder(folder, args.mib, args.shards)
        one = one_process(folder, files, args.repeats)
        ranks = two_ranks(folder, args.repeats)
    print(
        f"{args.mib} MiB fp32 in {args.shards} shards, page cache dropped, medians of "
        f"{args.repeats}"
    )
    print(f"{'case':<40} {'aiockpt s':>10} {'other s':>10} {'ratio':>7}")
    print(
        f"{'1 process, plain tensors vs load_file':<40} {one['aiockpt']:>10.3f} "
        f"{one['safetensors']:>10.3f} {one['aiockpt'] / one['safetensors']:>7.2f}"
    )
    r0 = ranks[0]
    other = r0.get("dcp")
    shown = f"{other:>10.3f} {r0['aiockpt'] / other:>7.2f}" if other else f"{'n/a':>10} {'':>7}"
    print(f"{'2 ranks FSDP2 vs DCP HF reader':<40} {r0['aiockpt']:>10.3f} {shown}")
    shown = ", ".join(f"{r['read_ratio']:.3f}" for r in ranks)
    print(f"bytes read / bytes needed per rank (aiockpt): {shown}")


if __name__ == "__main__":
    main()
