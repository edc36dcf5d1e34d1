"""Recovery from the tiers: how long a relaunched job takes to restore its state, by where
the state comes from (docs/tiers.md).

4 gloo ranks on 127.0.0.1 as 2 simulated hosts (``AIOCKPT_HOST_ID``), each host's local tier
its own directory, ``LocalTier(keep=2, replicas=1)``, the root on S3 (moto's server on
127.0.0.1, with the ranged-GET front of s3_load_bench.py). The state (``--mib`` in all, in 16
float32 tensors a rank) is saved a few times with ``persist_every=1``, so that the last step
is in both tiers and in the root; then, in a fresh set of 4 processes each repeat, page cache
dropped first (as root), the time from ``open()`` to a restored state (``load(into=)``), the
slowest rank's, from a barrier:

- **own tier**: every rank reads its shard from its host's tier;
- **peer**: host B's ranks come back as a fresh host (a new ``AIOCKPT_HOST_ID``, an empty
  directory): they read their shards from their partners on host A as they load;
- **S3 root**: both tiers empty: every rank reads from the root;
- **raw read**: each rank reads its shard files from its host's tier into memory already
  allocated, no manager (the floor for the own tier).

And the saves' stall (``await mgr.save()``, the slowest rank's, median of the saves after
the first) with the tier and without it (the root alone), and the bytes those saves wrote to
the root each way (the objects left under each prefix: every write is a new object). With
``persist_every=1`` both ways write every step to the root, so the tier must add nothing
there; ``persist_every=k`` writes a k-th of the steps. Medians of ``--repeats``.

    python benchmarks/recovery_bench.py [--mib 256] [--repeats 3] [--saves 3]
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
import time
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from dedup_load_bench import drop_cache  # noqa: E402
from s3_load_bench import BUCKET, KEY, SECRET, free_port, start_server, storage_options  # noqa: E402

MiB = 1024 * 1024
TENSORS = 16
WORLD = 4


# --- one rank ---------------------------------------------------------------------------------


def make_state(rank: int, numel: int, step: int) -> dict:
    """Rank ``rank``'s state as saved at ``step`` (each save adds 1 to every tensor)."""
    import torch

    g = torch.Generator().manual_seed(rank)
    model = {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(TENSORS)}
    for _ in range(step - 1):
        for t in model.values():
            t.add_(1)
    return {"model": model, "step": step}


def manager(args: dict, rank: int, tier: bool) -> Any:
    from aiockpt import AsyncCheckpointManager, LocalTier

    options = storage_options(args["endpoint"], None, None)
    if not tier:
        return AsyncCheckpointManager(args["root"], storage_options=options, dist_timeout=300)
    host = args["hosts"][rank]
    os.environ["AIOCKPT_HOST_ID"] = host
    return AsyncCheckpointManager(
        args["root"],
        storage_options=options,
        dist_timeout=300,
        start_timeout=300,
        local=LocalTier(args["local"][host], keep=2, replicas=1),
        persist_every=1,
    )


async def rank_save(rank: int, args: dict) -> dict:

    import torch.distributed as dist

    state = make_state(rank, args["numel"], 1)
    stalls = []
    async with manager(args, rank, args["tier"]) as mgr:
        for step in range(1, args["saves"] + 1):
            if step > 1:
                for t in state["model"].values():
                    t.add_(1)
            state["step"] = step
            dist.barrier()
            t0 = time.perf_counter()
            handle = await mgr.save(step, state)
            stalls.append(time.perf_counter() - t0)
            await handle
    return {"stalls": stalls}


async def rank_resume(rank: int, args: dict) -> dict:

    import torch
    import torch.distributed as dist

    names = [f"layer{i}.weight" for i in range(TENSORS)]
    target = {"model": {k: torch.zeros(args["numel"]) for k in names}, "step": 0}
    dist.barrier()
    t0 = time.perf_counter()
    mgr = manager(args, rank, True)
    await mgr.open()
    opened = time.perf_counter() - t0
    try:
        await mgr.load(into=target)
        took = time.perf_counter() - t0
    finally:
        await mgr.aclose()
    want = make_state(rank, args["numel"], args["saves"])
    exact = target["step"] == args["saves"] and all(
        torch.equal(target["model"][k], want["model"][k]) for k in want["model"]
    )
    return {"s": took, "open_s": opened, "exact": exact}


async def rank_raw(rank: int, args: dict) -> dict:

    import torch
    import torch.distributed as dist

    step_dir = Path(args["local"][args["hosts"][rank]]) / f"step_{args['saves']:012d}"
    files = [step_dir / f for f in os.listdir(step_dir) if f.startswith(f"shard_r{rank:05d}")]
    sizes = [os.path.getsize(f) for f in files]
    buf = torch.ones(sum(sizes), dtype=torch.uint8)  # memory already there, as into= has
    view = memoryview(buf.numpy()).cast("B")
    dist.barrier()
    t0 = time.perf_counter()
    at = 0
    for f, size in zip(files, sizes, strict=True):
        with open(f, "rb", buffering=0) as fh:
            got = 0
            while got < size:
                n = fh.readinto(view[at + got : at + size])
                assert n, f"{f}: short read"
                got += n
        at += size
    return {"s": time.perf_counter() - t0, "open_s": 0.0, "bytes": at}


def serve_rank() -> None:
    import anyio
    import torch.distributed as dist

    mode, rank, store, out, raw = sys.argv[2:7]
    args, r = json.loads(raw), int(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=r, world_size=WORLD)
    try:
        fn = {"save": rank_save, "resume": rank_resume, "raw": rank_raw}[mode]
        result = anyio.run(fn, r, args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/_support/ranks.py: no gloo teardown at exit


# --- the job ----------------------------------------------------------------------------------


def run_job(work: Path, mode: str, args: dict) -> list[dict]:
    """4 fresh rank processes, their own store file; each rank's result."""
    run = work / f"run{len(list(work.glob('run*')))}"
    run.mkdir()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    procs, outs = [], []
    for rank in range(WORLD):
        out = run / f"{rank}.json"
        outs.append(out)
        cmd = [sys.executable, __file__, "--rank", mode, str(rank), str(run / "store"), str(out)]
        procs.append(subprocess.Popen([*cmd, json.dumps(args)], env=env))
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0] * WORLD:
        raise RuntimeError(f"{mode}: rank exit codes {codes}")
    return [json.loads(o.read_text()) for o in outs]


def fmt(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        serve_rank()
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="the whole state, over 4 ranks")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--saves", type=int, default=3, help="saves each way (stall: after the 1st)")
    p.add_argument("--dir", default=None, help="where the tiers go (default: a temp dir)")
    a = p.parse_args()
    import boto3

    numel = a.mib * MiB // WORLD // TENSORS // 4
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = start_server(port, plain=False)
    work = Path(tempfile.mkdtemp(dir=a.dir, prefix="recovery-bench-"))
    try:
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=BUCKET)
        base = {"endpoint": endpoint, "numel": numel, "saves": a.saves}

        def job(hosts: tuple[str, str], root: str, tier: bool = True) -> dict:
            local = {h: str(work / f"local-{h}") for h in hosts}
            for d in local.values():
                os.makedirs(d, exist_ok=True)
            h0, h1 = hosts
            return {**base, "root": root, "tier": tier, "hosts": [h0, h0, h1, h1], "local": local}

        def stall(runs: list[dict]) -> float:
            per_save = [max(r["stalls"][i] for r in runs) for i in range(1, a.saves)]
            return statistics.median(per_save)

        def written(prefix: str) -> int:
            """The bytes the saves left in the root: every write there is a new object."""
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            return sum(o["Size"] for page in pages for o in page.get("Contents", ()))

        root = f"s3://{BUCKET}/run"
        stall_plain = stall(run_job(work, "save", job(("x", "y"), f"s3://{BUCKET}/plain", False)))
        stall_tier = stall(run_job(work, "save", job(("a", "b"), root)))
        traffic = {"tier": written("run/"), "plain": written("plain/")}

        times: dict[str, list[float]] = {"own": [], "peer": [], "s3": [], "raw": []}
        opens: dict[str, list[float]] = {k: [] for k in times}
        dropped = True

        def timed(kind: str, mode: str, args: dict) -> None:
            nonlocal dropped
            dropped = drop_cache() and dropped
            runs = run_job(work, mode, args)
            if mode == "resume":
                assert all(r["exact"] for r in runs), f"{kind}: not restored bit-exact"
            times[kind].append(max(r["s"] for r in runs))
            opens[kind].append(max(r["open_s"] for r in runs))

        for i in range(a.repeats):
            timed("raw", "raw", job(("a", "b"), root))
            timed("own", "resume", job(("a", "b"), root))
            timed("peer", "resume", job(("a", f"c{i}"), root))  # an empty tier: from host a
            shutil.rmtree(work / f"local-c{i}")
            timed("s3", "resume", job((f"e{i}", f"f{i}"), root))  # both tiers empty: the root
            for h in (f"e{i}", f"f{i}"):
                shutil.rmtree(work / f"local-{h}")
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    omed = {k: statistics.median(v) for k, v in opens.items()}
    print(
        f"{a.mib} MiB over {WORLD} ranks on 2 simulated hosts ({a.mib // WORLD} MiB a rank, "
        f"{TENSORS} tensors), LocalTier(keep=2, replicas=1), root on moto S3 at 127.0.0.1; "
        f"median of {a.repeats}, page cache {'dropped' if dropped else 'NOT dropped'} each time"
    )
    print("| restored from | open() → restored | of which open() | all runs |")
    print("|---|---:|---:|---|")
    labels = {
        "own": "own local tier",
        "peer": "peer (host B replaced)",
        "s3": "S3 root (tiers empty)",
        "raw": "raw read of the shards",
    }
    for k, label in labels.items():
        runs = ", ".join(fmt(t) for t in times[k])
        of_open = fmt(omed[k]) if k != "raw" else "—"
        print(f"| {label} | {fmt(med[k])} | {of_open} | {runs} |")
    print()
    print(
        "| peer ÷ S3 | own tier ÷ raw read | save stall: tier | save stall: root alone "
        "| root bytes written: tier ÷ root alone |"
    )
    print("|---:|---:|---:|---:|---:|")
    print(
        f"| {med['peer'] / med['s3']:.2f} | {med['own'] / med['raw']:.2f} "
        f"| {fmt(stall_tier)} | {fmt(stall_plain)} "
        f"| {traffic['tier'] / traffic['plain']:.3f} ({traffic['tier'] / MiB:.0f} MiB) |"
    )


if __name__ == "__main__":
    main()
