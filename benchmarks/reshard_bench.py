"""Resharding DTensor checkpoints: aiockpt against PyTorch DCP, and the planning cost at scale.

Part 1, real ranks. FSDP2-sharded state (a stack of ``nn.Linear`` layers, ``fully_shard`` on
a 1-D CPU gloo mesh, AdamW moments initialised: parameters and both moments make up the
state's size) is saved on 4 gloo ranks and loaded on 2, then saved on 2 and loaded on 4, by
each contender in turn, on the same disk:

- ``aiockpt``: ``await mgr.save(step, state)`` (+ ``await handle``) and
  ``await mgr.load(step, into=state)``;
- ``dcp``: ``torch.distributed.checkpoint.save`` and ``.load`` of the same state dict.

The state is ``{"model": ..., "optim": ...}`` from ``get_state_dict(model, optimizer)``, so
both contenders see the same DTensors. Every rank is a real process (torch.distributed over a
``file://`` store on 127.0.0.1, ``OMP_NUM_THREADS=1``); each save and each load is one set of
processes with a time limit, and a failure is recorded, never fatal. Every value is a
function of its global index, so each loading rank checks that its shards came back
bit-identical. Figures:

- save: the stall (until ``await mgr.save`` returns) ÷ one memcpy of the rank's local bytes
  in the same process, the medians of as many of each, taken in turns (a memcpy, then a
  save), each after a barrier on every rank at once; DCP's blocking save;
- load: wall time of the slowest rank (page cache dropped before each, after a barrier),
  aiockpt ÷ DCP, for the first load of a fresh process (a resume) and the later ones; each
  contender's load job runs ``--rounds`` times, the contenders taking turns, and the first
  load is the median of the rounds' (one per fresh set of processes);
- bytes read per rank ÷ bytes the rank needs (its local shards): what aiockpt's ``load.end``
  event reports (``read_nbytes``), and for both contenders ``rchar`` of ``/proc/PID/io``
  (bytes passed through read syscalls, of the trainer and, for aiockpt, of its daemon too,
  which does the reading), and ``read_bytes`` (bytes the block layer fetched, read-ahead
  included), summed over the ranks: a page one rank faulted in is another rank's cache hit.

Part 2, planning at scale, in one process, no I/O: each of N simulated ranks' entries for 200
DTensors (Shard(0) on an (N,) mesh) built as a daemon builds them, merged into a manifest as
rank 0's daemon merges them, parsed as a load parses it (each record checked as it is used),
and the read plan of a rank of a 512-rank target layout computed as the daemon's assembler
computes it (``read_plan`` of the wanted box against the chunks ``DTensorRecord.covering``
finds by bisection on dim 0 and checks): a loading rank pays the parse and its first plan.
Cross-checked on a sample of target ranks against a fully checked parse (as ``verify`` makes
it) with every chunk tried. Timed at 256, 512 and 1024 ranks; the largest is profiled.

Results: a markdown table on stdout, ``reshard.json`` in the output directory (compare.py's:
docs/, or bench-data/ with --quick; bench-data/ when run on its own).

    python benchmarks/compare.py --scenarios reshard [--quick]   # or, the same:
    python benchmarks/reshard_bench.py [--quick] [--parts reshard,plan] [--size-mib 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import math
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]

from compare import (  # noqa: E402  (after the path set-up, for both entry points)
    GiB,
    MiB,
    drop_cache,
    fmt_f,
    fmt_s,
    fs_type,
    last_error,
    machine_info,
    mem_available,
)

from aiockpt._core import dtable  # noqa: E402  (neither imports torch)
from aiockpt._core.chunks import byte_span, read_plan  # noqa: E402

#: (saved on, loaded on): consolidating onto fewer ranks, and spreading onto more.
LAYOUTS = ((4, 2), (2, 4))
CONTENDERS = ("aiockpt", "dcp")
LABELS = {"aiockpt": "aiockpt", "dcp": "DCP save/load"}
#: Linear layers of the model; the width follows from the state's size.
LAYERS = {False: 16, True: 8}
#: Planning: simulated saving ranks, DTensors, and the ranks of the layout loading them.
PLAN = {
    False: {"ranks": (256, 512, 1024), "tensors": 200, "target": 512, "sample": 8},
    True: {"ranks": (16, 32, 64), "tensors": 20, "target": 32, "sample": 32},
}
#: DTensor shapes of the planning state, in turn (a transformer's square, MLP and norm
#: weights): 4096 rows shard evenly over any power of two up to 4096 ranks, 11008 do not
#: (ranks past 11008 / 11 hold an empty chunk at 1024 ranks).
PLAN_SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (4096,))
#: Peak memory of one rank, in multiples of its local state (state, slab, memcpy buffers).
RANK_MEM_FACTOR = 4.0


# =========================================================================== rank side


def width(nbytes: int, layers: int) -> int:
    """The layers' width for a state of about ``nbytes`` (params and two moments, float32):
    2 modulo 4, so that 4 ranks shard the rows unevenly and the 2- and 4-rank boundaries
    do not line up (a reshard reads parts of chunks both ways)."""
    return max(int(math.sqrt(nbytes / (3 * layers * 4))) // 4 * 4 + 2, 6)


def value_of(name: str, start: int, numel: int):
    """The elements ``[start, start + numel)`` (global, row-major) of the tensor ``name``:
    exact integers in float32, different for every tensor."""
    import torch

    salt = zlib.crc32(name.encode()) % 1_000_003
    idx = torch.arange(start, start + numel, dtype=torch.int64)
    return ((idx * 40503 + salt) % 16_777_213).to(torch.float32)


def tensors_of(state: dict[str, Any]):
    """(name, tensor) for every tensor of ``{"model": sd, "optim": osd}``."""
    import torch

    for key, t in state["model"].items():
        yield f"model/{key}", t
    for fqn, st in state["optim"]["state"].items():
        for key, t in st.items():
            if isinstance(t, torch.Tensor):
                yield f"optim/{fqn}/{key}", t


def local_span(t) -> tuple[Any, int]:
    """A DTensor's local tensor and the global row-major index of its first element (its
    placement is Shard(0), so the local rows are one run of the global elements)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert all(isinstance(p, Shard) and p.dim == 0 for p in t.placements), t.placements
    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), int(offsets[0]) * math.prod(t.shape[1:])


def build_state(world: int, cfg: dict[str, Any], fill: bool) -> dict[str, Any]:
    """The FSDP2 state of this rank: values by their global index when ``fill``, zeros
    otherwise (a target to load into)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    dim, layers = cfg["dim"], cfg["layers"]
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model_sd, optim_sd = get_state_dict(model, opt)  # a zero-grad step: AdamW's moments exist
    state = {"model": model_sd, "optim": optim_sd}
    with torch.no_grad():
        for name, t in tensors_of(state):
            if isinstance(t, DTensor):
                local, start = local_span(t)
                if fill:
                    local.copy_(value_of(name, start, local.numel()).view(local.shape))
                else:
                    local.zero_()
    return state


def local_tensors(state: dict[str, Any]) -> list:
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for _, t in tensors_of(state)]


def needed_bytes(state: dict[str, Any]) -> int:
    """What this rank must get back: its local shards and its plain tensors."""
    return sum(t.numel() * t.element_size() for t in local_tensors(state))


def mismatches(state: dict[str, Any]) -> list[str]:
    """The tensors whose local shard is not the saved value; then every shard is zeroed, so
    that the next load is checked on its own."""
    from torch.distributed.tensor import DTensor

    bad = []
    for name, t in tensors_of(state):
        if isinstance(t, DTensor):
            local, start = local_span(t)
            if not bool((local.reshape(-1) == value_of(name, start, local.numel())).all()):
                bad.append(name)
            local.zero_()
    return bad


class Memcpy:
    """One copy of this rank's local bytes into a warm buffer, timed after a barrier (every
    rank copying at once, as every rank saves at once): taken before each measured save, so
    that the floor and the save are measured in the same conditions and compared median to
    median."""

    def __init__(self, state: dict[str, Any]) -> None:
        import torch

        self.src = torch.cat([t.reshape(-1).view(torch.uint8) for t in local_tensors(state)])
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # faults the destination in
        self.times: list[float] = []

    def __call__(self) -> None:
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        self.times.append(time.perf_counter() - t0)


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """``rchar`` and ``read_bytes`` of a process (its threads, live and gone, included)."""
    with open(f"/proc/{pid}/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return {k: int(fields[k]) for k in ("rchar", "read_bytes")}


def io_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def drop_before_load(rank: int, path: str, cache: str) -> str:
    """Rank 0 drops the page cache of ``path``; every rank then starts together."""
    import torch.distributed as dist

    how = drop_cache([path], cache) if rank == 0 else ""
    dist.barrier()
    return how


async def save_aiockpt(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """A warm-up save, then the measured saves, each after a memcpy: stall and until
    committed."""
    import torch.distributed as dist

    from aiockpt import AsyncCheckpointManager

    state = build_state(world, cfg, fill=True)
    memcpy = Memcpy(state)
    stalls, durables = [], []
    async with AsyncCheckpointManager(cfg["root"], dist_timeout=cfg["timeout"]) as mgr:
        await (await mgr.save(0, state))  # warm-up: slab allocated, layout cached
        for step in range(1, cfg["repeats"] + 1):
            memcpy()
            dist.barrier()
            t0 = time.perf_counter()
            handle = await mgr.save(step, state)
            stalls.append(time.perf_counter() - t0)
            await handle
            durables.append(time.perf_counter() - t0)
    saved = {"stall_s": stalls, "durable_s": durables}
    return {"memcpy_s": memcpy.times, "local_bytes": needed_bytes(state), **saved}


async def save_dcp(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """A warm-up save, then the measured ``dcp.save`` calls (they block), each after a
    memcpy."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = build_state(world, cfg, fill=True)
    memcpy = Memcpy(state)
    dcp.save(state, checkpoint_id=os.path.join(cfg["root"], "warm-up"))
    times = []
    for step in range(1, cfg["repeats"] + 1):
        memcpy()
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=os.path.join(cfg["root"], f"step-{step}"))
        times.append(time.perf_counter() - t0)
    saved = {"stall_s": times, "durable_s": times}
    return {"memcpy_s": memcpy.times, "local_bytes": needed_bytes(state), **saved}


async def load_aiockpt(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Loads into a zeroed state, each after the page cache is dropped; each checked."""
    from aiockpt import AsyncCheckpointManager

    state = build_state(world, cfg, fill=False)
    events: list[Any] = []
    runs = []
    handlers = [lambda e: events.append(e) if e.name == "load.end" else None]
    async with AsyncCheckpointManager(cfg["root"], event_handlers=handlers) as mgr:
        for _ in range(cfg["repeats"]):
            how = drop_before_load(rank, cfg["root"], cfg["cache"])
            pid = mgr.daemon_pid
            assert pid is not None
            mine, daemon = proc_io(), proc_io(pid)
            t0 = time.perf_counter()
            await mgr.load(cfg["step"], into=state)
            elapsed = time.perf_counter() - t0
            io = {"trainer": io_delta(mine, proc_io()), "daemon": io_delta(daemon, proc_io(pid))}
            runs.append({"load_s": elapsed, "io": io, "read_nbytes": events[-1].read_nbytes})
            runs[-1].update(cache=how, mismatches=mismatches(state))
    return {"runs": runs, "needed_bytes": needed_bytes(state)}


async def load_dcp(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """``dcp.load`` into a zeroed state, each after the page cache is dropped; each checked."""
    import torch.distributed.checkpoint as dcp

    state = build_state(world, cfg, fill=False)
    path = os.path.join(cfg["root"], f"step-{cfg['step']}")
    runs = []
    for _ in range(cfg["repeats"]):
        how = drop_before_load(rank, path, cfg["cache"])
        mine = proc_io()
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=path)
        elapsed = time.perf_counter() - t0
        runs.append({"load_s": elapsed, "io": {"trainer": io_delta(mine, proc_io())}})
        runs[-1].update(cache=how, mismatches=mismatches(state))
    return {"runs": runs, "needed_bytes": needed_bytes(state)}


ROLES = {f.__name__: f for f in (save_aiockpt, save_dcp, load_aiockpt, load_dcp)}


def rank_main(spec: dict[str, Any]) -> None:
    """One rank of one job: join the group, run the role, write what it saw."""
    import anyio
    import torch.distributed as dist

    # Imported before anything is timed: DCP imports its planner and storage lazily.
    import torch.distributed.checkpoint  # noqa: F401

    rank, world = spec["rank"], spec["world"]
    dist.init_process_group(
        "gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world
    )
    try:
        result = anyio.run(ROLES[spec["role"]], rank, world, spec["cfg"])
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(spec["out"]).write_text(json.dumps(result))


# =========================================================================== planning side


def plan_state(ranks: int, tensors: int) -> tuple[list[Any], dict[tuple[int, ...], list[Any]]]:
    """Each rank's chunk of each planning DTensor: names with their shapes, and per shape the
    chunk of every rank (torch's own chunking, computed once per shape)."""
    from torch.distributed.tensor import Shard

    from aiockpt._trainer.dtensor import chunk_at

    names = [(f"layers/{i // 4}/w{i % 4}", PLAN_SHAPES[i % 4]) for i in range(tensors)]
    by_shape = {
        shape: [chunk_at(shape, (ranks,), (r,), [Shard(0)]) for r in range(ranks)]
        for shape in {s for _, s in names}
    }
    return names, by_shape


def rank_part(rank: int, ranks: int, names: list[Any], by_shape: dict[Any, list[Any]]) -> Any:
    """What rank ``rank``'s daemon sends rank 0: its shard record, manifest tensor entries
    (the chunks it writes), tree, and DTensor entries with the chunks' block crcs."""
    from aiockpt._core import format as fmt
    from aiockpt._daemon.coord import Part

    entries, specs, blocks, pos = [], [], {}, 0
    for name, shape in names:
        chunk = by_shape[shape][rank]
        written = chunk if chunk.numel else None
        entries.append(dtable.RankEntry(name, "F32", shape, ("Shard(dim=0)",), (ranks,), written))
        if written is not None:
            n = chunk.numel * 4
            specs.append(fmt.TensorSpec(name, "F32", chunk.sizes, pos, pos + n))
            # Stand-in crcs: their count is what the manifest's size and parse depend on.
            blocks[name] = [(rank * 7919 + i) & 0xFFFFFFFF for i in range(-(-n // 65536))]
            pos += n
    crcs = [(rank + i) & 0xFFFFFFFF for i in range(len(specs))]
    tensors = fmt.tensors_json(specs, fmt.ALIGN, crcs)
    tree = json.dumps({"D": [[n, {"X": n}] for n, _ in names]}, separators=(",", ":"))
    shard = {
        "file": fmt.shard_filename(rank),
        "rank": rank,
        "nbytes": fmt.ALIGN + pos,
        "crc32c": rank,
    }
    return Part(rank, shard, tensors, tree, dtable.rank_json(entries, blocks))


def read_range(saved: Any, runs: list[Any], block: int) -> tuple[str, int, int, list[Any]]:
    """The bytes of a saved chunk the daemon's Assembler reads for ``runs``: the whole chunk,
    or the blocks that hold them."""
    lo, hi = byte_span(runs)
    n = saved.nbytes
    if not (lo == 0 and hi == n):
        first, end = dtable.blocks_for(lo, hi, n, block)
        lo, hi = first * block, min(end * block, n)
    return saved.shard, lo, hi, runs


def rank_plan(records: dict[str, Any], boxes: dict[str, Any], block: int) -> list[tuple]:
    """One target rank's plan as aiockpt's Assembler.fill makes it: the saved chunks that
    DTensorRecord.covering finds by bisection on dim 0 (checked as it finds them)."""
    plan = []
    for name, rec in records.items():
        box = boxes[name]
        for saved in rec.covering(box):
            plan.append((name, *read_range(saved, read_plan(saved.chunk, box, 4), block)))
    return plan


def brute_plan(records: dict[str, Any], boxes: dict[str, Any], block: int) -> list[tuple]:
    """The same plan by trying every saved chunk of a fully checked table: the cross-check."""
    plan = []
    for name, rec in records.items():
        box = boxes[name]
        for saved in sorted(rec.chunks, key=lambda c: c.chunk.offsets[0]):
            runs = read_plan(saved.chunk, box, 4)
            if runs:
                plan.append((name, *read_range(saved, runs, block)))
    return plan


def timed_s(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def plan_main(spec: dict[str, Any]) -> None:
    """Part 2 at one number of saving ranks; writes its timings (and a profile) to OUT.

    Merge runs with the cyclic GC on, as in the daemon's commit; parse and plan with it
    paused, as in the daemon's Reader.load; the collection the pause defers is timed too."""
    import gc

    from aiockpt._core import format as fmt
    from aiockpt._core.gc import gc_paused
    from aiockpt._daemon.coord import merge

    ranks, tensors, target = spec["ranks"], spec["tensors"], spec["target"]
    names, by_shape = plan_state(ranks, tensors)
    parts, build_s = timed_s(lambda: [rank_part(r, ranks, names, by_shape) for r in range(ranks)])
    texts = [(p.shard["file"], p.dtensors_json) for p in parts]
    _, dtable_merge_s = timed_s(lambda: dtable.merge(texts))
    data, merge_s = timed_s(lambda: merge(parts, step=1, created_at=1.0, metrics={}, metadata={}))
    # The target layout's boxes are the loading trainers' part: computed, not timed.
    target_chunks = plan_state(target, tensors)[1]
    boxes = [{n: target_chunks[s][t] for n, s in names} for t in range(target)]
    k = min(spec["sample"], target)
    sample = sorted({round(i * (target - 1) / max(k - 1, 1)) for i in range(k)})
    gc.collect()
    with gc_paused():
        _, decode_s = timed_s(lambda: json.loads(data))
        # As the reader parses: records checked as they are used.
        m, parse_s = timed_s(lambda: fmt.parse_manifest(data, path="m", step=1, lazy=True))
        plan, plan_s = timed_s(lambda: rank_plan(m.dtensors, boxes[sample[0]], m.block_bytes))
        later = [
            timed_s(lambda t=t: rank_plan(m.dtensors, boxes[t], m.block_bytes)) for t in sample
        ]
        # As verify and the CLI parse: all of it checked up front.
        full, full_parse_s = timed_s(lambda: fmt.parse_manifest(data, path="m", step=1))
        agrees = all(
            got == brute_plan(full.dtensors, boxes[t], full.block_bytes)
            for t, (got, _) in zip(sample, later, strict=True)
        )
        t0 = time.perf_counter()
    # Turned back on, the GC collects once everything allocated while it was off.
    deferred_gc_s = time.perf_counter() - t0
    out = {
        "ranks": ranks,
        "tensors": tensors,
        "target_ranks": target,
        "chunks": sum(len(r.chunks) for r in full.dtensors.values()),
        "blocks": sum(len(c.blocks) for r in full.dtensors.values() for c in r.chunks),
        "manifest_bytes": len(data),
        "build_parts_s": build_s,
        "dtable_merge_s": dtable_merge_s,
        "merge_s": merge_s,
        "decode_s": decode_s,
        "parse_s": parse_s,
        "full_parse_s": full_parse_s,
        "deferred_gc_s": deferred_gc_s,
        "plan_sampled_targets": sample,
        "plan_first_s": plan_s,
        "plan_later_s": statistics.mean(t for _, t in later[1:] or later),
        "plan_agrees": agrees and plan == later[0][0],
        "read_bytes_per_target": statistics.mean(sum(p[3] - p[2] for p in g) for g, _ in later),
        "load_side_s": parse_s + plan_s,
        "total_s": merge_s + parse_s + plan_s,
    }
    if spec.get("profile"):
        out["profile"] = profile(parts, data, m, boxes[sample[len(sample) // 2]])
    Path(spec["out"]).write_text(json.dumps(out))


def profile(parts: list[Any], data: bytes, m: Any, boxes: dict[str, Any]) -> list[dict]:
    """Where merge, a load's parse_manifest and one target's plan spend their time: the top
    functions by their own time."""
    from aiockpt._core import format as fmt
    from aiockpt._core.gc import gc_paused
    from aiockpt._daemon.coord import merge

    prof = cProfile.Profile()
    prof.enable()
    merge(parts, step=1, created_at=1.0, metrics={}, metadata={})
    with gc_paused():
        lazy = fmt.parse_manifest(data, path="m", step=1, lazy=True)
        rank_plan(lazy.dtensors, boxes, m.block_bytes)
    prof.disable()
    stats: Any = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        where = f"{Path(file).name}:{line}" if line else file
        rows.append(
            {"function": func, "where": where, "calls": ncalls, "self_s": tottime, "cum_s": cumtime}
        )
    rows.sort(key=lambda r: -r["self_s"])
    return rows[:14]


# =========================================================================== driver side


def rank_env() -> dict[str, str]:
    # Four ranks share the machine's cores: one intra-op thread each, gloo on the loopback.
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")


def run_job(role: str, world: int, cfg: dict[str, Any], job_dir: str, timeout: float) -> dict:
    """Run ``role`` on ``world`` rank processes; every rank's result, or why there is none.

    Each rank has a session of its own, so a timeout or a failed rank takes its whole group
    (aiockpt's daemon with it); the others are stopped too, as they would wait for it forever.
    """
    os.makedirs(job_dir, exist_ok=True)
    store = os.path.join(job_dir, f"store-{role}-{time.monotonic_ns()}")
    procs, outs, logs = [], [], []
    for rank in range(world):
        out = os.path.join(job_dir, f"{role}-{rank}.json")
        log = open(os.path.join(job_dir, f"{role}-{rank}.log"), "wb")  # noqa: SIM115
        spec = {"role": role, "rank": rank, "world": world, "store": store, "out": out}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-worker"]
        cmd.append(json.dumps({**spec, "cfg": cfg}))
        procs.append(
            subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=rank_env()
            )
        )
        outs.append(out)
        logs.append(log)
    t0 = time.monotonic()
    status, failed = wait_all(procs, t0 + timeout)
    for log in logs:
        log.close()
    elapsed = time.monotonic() - t0
    if status == "ok":
        return {
            "status": "ok",
            "elapsed_s": elapsed,
            "ranks": [json.loads(Path(o).read_text()) for o in outs],
        }
    if status == "timeout":
        why = f"{role} on {world} ranks exceeded the {timeout:.0f} s limit"
    else:
        text = Path(logs[failed].name).read_text(errors="replace")
        why = f"{role}, rank {failed}: exit code {procs[failed].returncode}: {last_error(text)}"
    # What every rank printed (its daemon's output included), for the post-mortem in the JSON.
    tails = [scrub(Path(log.name).read_text(errors="replace")[-4000:]) for log in logs]
    return {"status": status, "why": why, "elapsed_s": elapsed, "log_tails": tails}


def scrub(text: str) -> str:
    """A log without this machine's paths."""
    for prefix in (str(REPO), sys.prefix, tempfile.gettempdir()):
        text = text.replace(prefix, "…")
    return text


def wait_all(procs: list[subprocess.Popen], deadline: float) -> tuple[str, int]:
    """("ok", -1) once every rank exited 0; ("failed", rank) at the first that did not;
    ("timeout", -1) at the deadline. Any rank still running then is killed."""
    status, failed = "ok", -1
    while any(p.poll() is None for p in procs):
        bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad:
            status, failed = "failed", bad[0]
            break
        if time.monotonic() > deadline:
            status = "timeout"
            break
        time.sleep(0.05)
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    if status == "ok":
        bad = [i for i, p in enumerate(procs) if p.returncode != 0]
        if bad:
            status, failed = "failed", bad[0]
    return status, failed


def summarise_save(job: dict[str, Any]) -> dict[str, Any]:
    """The slowest rank's stall and durable time, and the worst stall ÷ memcpy of a rank
    (medians of each)."""
    if job["status"] != "ok":
        return job
    ranks = job["ranks"]
    stalls = [statistics.median(r["stall_s"]) for r in ranks]
    memcpys = [statistics.median(r["memcpy_s"]) for r in ranks]
    return {
        "status": "ok",
        "stall_s": max(stalls),
        "durable_s": max(statistics.median(r["durable_s"]) for r in ranks),
        "memcpy_s": memcpys,
        "stall_over_memcpy": max(s / m for s, m in zip(stalls, memcpys, strict=True)),
        "local_bytes": [r["local_bytes"] for r in ranks],
        "elapsed_s": job["elapsed_s"],
        "ranks": ranks,
    }


def summarise_load(job: dict[str, Any]) -> dict[str, Any]:
    """Per load: the slowest rank's time, the worst rank's bytes read ÷ needed, and the disk
    reads of all ranks ÷ all they needed. The first load on its own, medians of the rest."""
    if job["status"] != "ok":
        return job
    ranks = job["ranks"]
    needed = [r["needed_bytes"] for r in ranks]
    loads = []
    for i in range(len(ranks[0]["runs"])):
        runs = [r["runs"][i] for r in ranks]
        rchar = [sum(io["rchar"] for io in run["io"].values()) for run in runs]
        disk = sum(io["read_bytes"] for run in runs for io in run["io"].values())
        counted = [run.get("read_nbytes") for run in runs]
        loads.append(
            {
                "load_s": max(run["load_s"] for run in runs),
                "rchar_over_needed": max(c / n for c, n in zip(rchar, needed, strict=True)),
                "disk_over_needed": disk / sum(needed),
                "counted_over_needed": None
                if None in counted
                else max(c / n for c, n in zip(counted, needed, strict=True)),
            }
        )
    # The first load of a fresh process is what a resume pays (aiockpt's sets up the staging
    # slab the next save uses); the later ones show the steady state.
    later = [x["load_s"] for x in loads[1:]]
    out: dict[str, Any] = {
        "status": "ok",
        "first_load_s": loads[0]["load_s"],
        "later_load_s": statistics.median(later) if later else None,
    }
    for key in ("rchar_over_needed", "disk_over_needed", "counted_over_needed"):
        vals = [x[key] for x in loads if x[key] is not None]
        out[key] = statistics.median(vals) if vals else None
    mismatched = sorted({m for r in ranks for run in r["runs"] for m in run["mismatches"]})
    return {
        **out,
        "identical": not mismatched,
        "mismatched": mismatched[:10],
        "needed_bytes": needed,
        "cache": ranks[0]["runs"][-1]["cache"],
        "loads": loads,
        "elapsed_s": job["elapsed_s"],
        "ranks": ranks,
    }


def state_config(nbytes: int, quick: bool) -> dict[str, Any]:
    layers = LAYERS[quick]
    dim = width(nbytes, layers)
    actual = 3 * layers * (dim * dim + dim) * 4
    return {
        "layers": layers,
        "dim": dim,
        "nbytes": actual,
        "tensors": 6 * layers,
        "label": f"{actual / MiB:.0f} MiB: {layers} × Linear({dim}, {dim}), params + AdamW moments",
    }


def reshard_part(opts: argparse.Namespace, scratch: str) -> dict[str, Any]:
    """Part 1: every layout; per layout each contender's save job, then ``opts.rounds`` rounds
    of load jobs, the contenders taking turns (so that a disk slower for a while slows both)."""
    state = state_config(opts.nbytes, opts.quick)
    cfg = {**state, "repeats": opts.repeats, "cache": opts.cache, "timeout": opts.timeout}
    need = int(state["nbytes"] * RANK_MEM_FACTOR) + GiB
    results: dict[str, Any] = {}
    for saved_on, loaded_on in LAYOUTS:
        key = f"{saved_on}to{loaded_on}"
        entries: dict[str, Any] = {}
        jobs: dict[str, dict[str, Any]] = {}  # the contenders saved, to load
        for c in CONTENDERS:
            root = os.path.join(scratch, f"{c}-{key}")
            if mem_available() < need:
                why = f"needs ~{need / GiB:.1f} GiB, {mem_available() / GiB:.1f} GiB available"
                entries[c] = {"save": {"status": "skipped", "why": why}}
                continue
            job = {**cfg, "root": root}
            entries[c] = {
                "save": summarise_save(run_job(f"save_{c}", saved_on, job, root, opts.timeout))
            }
            if entries[c]["save"]["status"] == "ok":
                jobs[c] = {**job, "step": opts.repeats}
        rounds: dict[str, list[dict[str, Any]]] = {c: [] for c in jobs}
        for _ in range(opts.rounds):
            for c, job in jobs.items():
                rounds[c].append(
                    summarise_load(run_job(f"load_{c}", loaded_on, job, job["root"], opts.timeout))
                )
        for c, job in jobs.items():
            entries[c]["load"] = merge_rounds(rounds[c])
            shutil.rmtree(job["root"], ignore_errors=True)
        for c, entry in entries.items():
            print(f"  reshard {saved_on} → {loaded_on} ranks  {LABELS[c]:<14} {brief(entry)}")
        results[key] = entries
    return {"state": state, "layouts": results}


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's load jobs (each summarise_load's) as one: the median of the rounds'
    first loads, of every later load, and of the rounds' bytes ratios; the first failed
    round instead, if one failed."""
    failed = [r for r in rounds if r["status"] != "ok"]
    if failed:
        return failed[0]
    later = [x["load_s"] for r in rounds for x in r["loads"][1:]]
    out: dict[str, Any] = {
        "status": "ok",
        "first_load_s": statistics.median(r["first_load_s"] for r in rounds),
        "first_loads_s": [r["first_load_s"] for r in rounds],
        "later_load_s": statistics.median(later) if later else None,
    }
    for key in ("rchar_over_needed", "disk_over_needed", "counted_over_needed"):
        vals = [r[key] for r in rounds if r[key] is not None]
        out[key] = statistics.median(vals) if vals else None
    mismatched = sorted({m for r in rounds for m in r["mismatched"]})
    return {**out, "identical": not mismatched, "mismatched": mismatched[:10], "rounds": rounds}


def brief(entry: dict[str, Any]) -> str:
    save, load = entry["save"], entry.get("load", {})
    if save["status"] != "ok":
        return f"save {save['status']}: {save['why'][:150]}"
    text = f"stall {fmt_s(save['stall_s'])} ({fmt_f(save['stall_over_memcpy'])}× memcpy)"
    if load.get("status") != "ok":
        return f"{text}; load {load.get('status')}: {load.get('why', '')[:150]}"
    return (
        f"{text}; load {fmt_s(load['first_load_s'])} first, {fmt_s(load['later_load_s'])} "
        f"later, rchar {fmt_f(load['rchar_over_needed'])}× needed, "
        f"identical: {load['identical']}"
    )


def plan_part(opts: argparse.Namespace, scratch: str) -> dict[str, Any]:
    """Part 2: one process per number of saving ranks, the largest one profiled too."""
    conf = PLAN[opts.quick]
    rows = []
    for ranks in conf["ranks"]:
        out = os.path.join(scratch, f"plan-{ranks}.json")
        spec = {**conf, "ranks": ranks, "out": out, "profile": ranks == conf["ranks"][-1]}
        print(f"  planning {ranks} ranks × {conf['tensors']} DTensors", end="", flush=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--plan-worker", json.dumps(spec)]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, timeout=opts.timeout, check=False)
            if proc.returncode == 0:
                row = {"status": "ok", **json.loads(Path(out).read_text())}
            else:
                err = last_error((proc.stdout + proc.stderr).decode(errors="replace"))
                row = {"status": "failed", "why": f"exit code {proc.returncode}: {err}"}
        except subprocess.TimeoutExpired:
            row = {"status": "timeout", "why": f"exceeded the {opts.timeout:.0f} s limit"}
        row.update(ranks=ranks, elapsed_s=time.monotonic() - t0)
        rows.append(row)
        print(f" total {fmt_s(row['total_s'])}" if row["status"] == "ok" else f" {row['why']}")
    return {"config": {k: v for k, v in conf.items() if k != "ranks"}, "rows": rows}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def reshard_table(part: dict[str, Any]) -> list[str]:
    lines = [
        f"**Resharding FSDP2 state: {part['state']['label']}, {part['state']['tensors']} "
        "DTensors**",
        "",
        "| saved on → loaded on | contender | save stall (slowest rank) | stall ÷ memcpy "
        "(worst rank) | until durable | first load (slowest rank) | ÷ DCP | later loads "
        "| ÷ DCP | read_nbytes ÷ needed | rchar ÷ needed | disk reads ÷ needed "
        "| loaded bit-identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key, entries in part["layouts"].items():
        dcp = entries.get("dcp", {}).get("load", {})
        dcp = dcp if dcp.get("status") == "ok" else {}
        for c, entry in entries.items():
            head = f"| {key.replace('to', ' → ')} | {LABELS[c]} | "
            lines.append(head + " | ".join(reshard_cells(c, entry, dcp)) + " |")
    return lines


def reshard_cells(contender: str, entry: dict[str, Any], dcp: dict[str, Any]) -> list[str]:
    """The cells of one row of the resharding table (a failure fills the rest of its row)."""
    save, load = entry["save"], entry.get("load", {})
    if save["status"] != "ok":
        return [f"save {save['status']}: {esc(save['why'])}"] + [""] * 10
    cells = [fmt_s(save["stall_s"]), fmt_f(save["stall_over_memcpy"]), fmt_s(save["durable_s"])]
    if load.get("status") != "ok":
        why = f"load {load.get('status', 'not run')}: {esc(load.get('why', ''))}"
        return [*cells, why] + [""] * 7
    ours = contender != "dcp"
    return [
        *cells,
        fmt_s(load["first_load_s"]),
        fmt_f(ratio(load["first_load_s"], dcp.get("first_load_s"))) if ours else "1",
        fmt_s(load["later_load_s"]),
        fmt_f(ratio(load["later_load_s"], dcp.get("later_load_s"))) if ours else "1",
        fmt_f(load["counted_over_needed"], 3),
        fmt_f(load["rchar_over_needed"], 3),
        fmt_f(load["disk_over_needed"], 3),
        "yes" if load["identical"] else f"**no**: {', '.join(load['mismatched'])}",
    ]


def plan_table(part: dict[str, Any]) -> list[str]:
    conf = part["config"]
    lines = [
        f"**Planning: {conf['tensors']} DTensors, Shard(0) over N ranks, loaded by "
        f"{conf['target']} ranks**",
        "",
        "| saved ranks | chunks | block crcs | manifest | merge (rank 0, save) "
        "| parse (each loading rank) | plan (its first) | parse + plan | merge + parse + plan "
        "| total ÷ saved rank | later plans | plan = every chunk tried | GC the parse deferred "
        "| full parse (verify, CLI) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in part["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['ranks']} | {r['status']}: {esc(r['why'])} |||||||||||||")
            continue
        cells = [
            str(r["ranks"]),
            str(r["chunks"]),
            str(r["blocks"]),
            f"{r['manifest_bytes'] / MiB:.1f} MiB",
            fmt_s(r["merge_s"]),
            fmt_s(r["parse_s"]),
            fmt_s(r["plan_first_s"]),
            fmt_s(r["load_side_s"]),
            fmt_s(r["total_s"]),
            f"{r['total_s'] / r['ranks'] * 1e3:.2f} ms",
            fmt_s(r["plan_later_s"]),
            "yes" if r["plan_agrees"] else "**no**",
            fmt_s(r["deferred_gc_s"]),
            fmt_s(r["full_parse_s"]),
        ]
        lines.append(f"| {' | '.join(cells)} |")
    ok = [r for r in part["rows"] if r["status"] == "ok"]
    if len(ok) > 1:
        lines += ["", linearity(ok)]
    prof = next((r["profile"] for r in reversed(ok) if r.get("profile")), None)
    if prof:
        lines += [
            "",
            f"Profile of the merge, one parse and one target rank's plan at {ok[-1]['ranks']} "
            "ranks (cProfile, whose overhead inflates the many small calls):",
            "",
            "| function | where | calls | self | cumulative |",
            "|---|---|---:|---:|---:|",
        ]
        lines += [
            f"| `{p['function']}` | {p['where']} | {p['calls']} | {fmt_s(p['self_s'])} "
            f"| {fmt_s(p['cum_s'])} |"
            for p in prof[:10]
        ]
    return lines


def linearity(rows: list[dict[str, Any]]) -> str:
    """How each stage's cost per saved rank grows from the smallest run to the largest."""
    first, last = rows[0], rows[-1]

    def growth(key: str) -> str:
        return f"{(last[key] / last['ranks']) / (first[key] / first['ranks']):.2f}"

    return (
        f"Cost per saved rank at {last['ranks']} ÷ at {first['ranks']} (1.00 = linear): "
        f"merge {growth('merge_s')}, parse {growth('parse_s')}, plan of a loading rank "
        f"{growth('plan_first_s')}, total {growth('total_s')}."
    )


def esc(text: str) -> str:
    return text.replace("<", "&lt;").replace("|", "\\|")


def markdown(report: dict[str, Any]) -> str:
    lines: list[str] = []
    if "reshard" in report:
        lines += [*reshard_table(report["reshard"]), ""]
    if "plan" in report:
        lines += [*plan_table(report["plan"]), ""]
    return "\n".join(lines)


def options(args: argparse.Namespace) -> argparse.Namespace:
    """This benchmark's settings from compare.py's options (or this file's own)."""
    quick = bool(getattr(args, "quick", False))
    size_mib = getattr(args, "size_mib", None)
    repeats = getattr(args, "repeats", None) or (1 if quick else 3)
    rounds = getattr(args, "rounds", None) or (1 if quick else 3)
    # Four ranks each import torch and build their model on a loaded machine: a job needs
    # more than compare.py's per-contender limit of a quick run.
    timeout = max(getattr(args, "timeout", None) or 0, 120.0 if quick else 300.0)
    nbytes = size_mib * MiB if size_mib else (32 * MiB if quick else GiB)
    parts = getattr(args, "parts", None) or "reshard,plan"
    return argparse.Namespace(
        quick=quick,
        repeats=repeats,
        rounds=rounds,
        timeout=timeout,
        nbytes=nbytes,
        cache=getattr(args, "cache", None) or "global",
        parts=parts.split(","),
    )


def revision() -> str:
    """The commit measured, and whether aiockpt/ differed from it."""
    git = ["git", "-C", str(REPO)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run([*git, "status", "--porcelain", "aiockpt"], capture_output=True)
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" with local changes to aiockpt/" if dirty.stdout else "")


def run(args: argparse.Namespace, out_dir: Path, base: Path) -> dict[str, Any]:
    """Measure, print the tables and write ``reshard.json`` to ``out_dir``; checkpoints go
    in a scratch directory under ``base``."""
    opts = options(args)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "config": {
            "quick": opts.quick,
            "repeats": opts.repeats,
            "rounds": opts.rounds,
            "timeout_s": opts.timeout,
            "cache": opts.cache,
            "filesystem": fs_type(str(base)),
            "revision": revision(),
        },
    }
    t0 = time.monotonic()
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base, prefix="reshard-") as scratch:
        if "reshard" in opts.parts:
            report["reshard"] = reshard_part(opts, scratch)
        if "plan" in opts.parts:
            report["plan"] = plan_part(opts, scratch)
    report["elapsed_s"] = time.monotonic() - t0
    print(f"measured in {report['elapsed_s']:.0f} s\n")
    print(markdown(report))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "reshard.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return report


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="32 MiB of state, 16-64 ranks planned")
    p.add_argument("--parts", default="reshard,plan", help="reshard (real ranks), plan, or both")
    p.add_argument("--repeats", type=int, default=None, help="measured saves and loads per job")
    p.add_argument("--rounds", type=int, default=None, help="load jobs per contender (3)")
    p.add_argument("--size-mib", type=int, default=None, help="the state's size (1024)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per job")
    p.add_argument("--cache", choices=("global", "files", "warm"), default="global")
    p.add_argument("--dir", default=None, help="where checkpoints are written (bench-data/)")
    p.add_argument("--out-dir", default=None, help="reshard.json goes here (bench-data/)")
    p.add_argument("--rank-worker", help=argparse.SUPPRESS)
    p.add_argument("--plan-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_worker:
        rank_main(json.loads(args.rank_worker))
    elif args.plan_worker:
        plan_main(json.loads(args.plan_worker))
    else:
        base = Path(args.dir or REPO / "bench-data")
        run(args, Path(args.out_dir or REPO / "bench-data"), base)


if __name__ == "__main__":
    main()
