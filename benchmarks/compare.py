"""aiockpt side by side with torch.save and PyTorch DCP's async_save, on the same state and disk.

Contenders, each in a fresh subprocess (so peak RSS is its own and a hang or crash is recorded,
never fatal), each after one warm-up save, in one run:

- ``memcpy``: one copy of the bytes into a preallocated buffer (the floor for stalls);
- ``write_fsync``: a buffered write + fsync of the bytes to a fresh file (the floor for durable);
- ``torch_save``: ``torch.save`` of the state to a file, then fsync;
- ``dcp_thread`` / ``dcp_process``: ``torch.distributed.checkpoint.async_save`` with the thread
  and the process executor, on a world-size-1 gloo group;
- ``aiockpt``: ``await mgr.save(...)``, then ``await handle``;
- ``aiockpt_nodedup``: the same with ``dedup=False`` (every save writes its whole state): in
  a scenario where nothing repeats, the two side by side show what hashing costs;
- ``aiockpt_skip``: the same with ``skip_unchanged=True`` (tensors left as they were since the
  last save are neither copied nor read again);
- ``write_fsync_changed``: in the ``lora`` scenario only, a buffered write + fsync of the
  bytes an optimizer step changes (the floor for an incremental save; see lora_bench.py).

Figures: stall (until the call returns and the state may change), durable (until the bytes are
fsynced / committed), the trainer thread's CPU share (``thread_time`` ÷ wall while a pure-Python
loop runs during the in-flight save; GIL waits lower it), that loop's rate ÷ an idle window, and
peak RSS of the trainer and of its helper processes. Loads, with the files' page cache dropped
before each: aiockpt into existing tensors and into fresh ones against a raw read of the same
shard file, ``torch.load``, and DCP's ``load``.

    python benchmarks/compare.py                 # full run: writes docs/performance.{json,png}
    python benchmarks/compare.py --quick         # < 1 minute, writes bench-data/
    python benchmarks/compare.py --scenarios 1g --contenders memcpy,aiockpt --repeats 5
    python benchmarks/compare.py --scenarios reshard   # DTensors vs DCP: see reshard_bench.py
    python benchmarks/compare.py --scenarios lora,1g --repeats 3   # incremental: lora_bench.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lora_bench

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MiB = 1 << 20
GiB = 1 << 30

CONTENDERS = (
    "memcpy",
    "write_fsync_changed",
    "write_fsync",
    "torch_save",
    "dcp_thread",
    "dcp_process",
    "aiockpt",
    "aiockpt_nodedup",
    "aiockpt_skip",
)
LABELS = {
    "memcpy": "memcpy (floor)",
    "write_fsync_changed": "write+fsync (changed bytes, floor)",
    "write_fsync": "write+fsync (floor)",
    "torch_save": "torch.save+fsync",
    "dcp_thread": "DCP async (thread)",
    "dcp_process": "DCP async (process)",
    "aiockpt": "aiockpt",
    "aiockpt_nodedup": "aiockpt (dedup off)",
    "aiockpt_skip": "aiockpt (skip_unchanged)",
}
#: Contenders whose save call blocks until it is done: no loop runs during it.
BLOCKING = {"memcpy", "write_fsync", "torch_save"}


@dataclass(frozen=True)
class Scenario:
    key: str
    label: str
    tensors: int
    nbytes: int
    #: "plain": ``tensors`` tensors of ``nbytes`` in all, every byte changed between saves;
    #: "lora": a frozen base of ``nbytes`` plus adapters and their moments (lora_bench.py).
    kind: str = "plain"

    def applies(self, contender: str) -> bool:
        if self.kind == "lora":
            return contender in lora_bench.APPLIES
        # Every byte changes: the plain floor, and nothing for skip_unchanged to skip.
        return contender not in ("write_fsync_changed", "aiockpt_skip")

    def default(self, contender: str) -> bool:
        return contender in lora_bench.DEFAULT if self.kind == "lora" else self.applies(contender)


LORA_LABEL = "LoRA: {} frozen + adapters + AdamW moments, 10 saves"
SCENARIOS = {
    "1g": Scenario("1g", "1 GiB / 64 tensors", 64, GiB),
    "20k": Scenario("20k", "256 MiB / 20k tensors", 20_000, 256 * MiB),
    "4g": Scenario("4g", "4 GiB / 64 tensors", 64, 4 * GiB),
    "lora": Scenario("lora", LORA_LABEL.format("1 GiB"), 112, GiB, "lora"),
}
#: --quick: small sizes that keep the shape of each scenario, 4 GiB left out.
QUICK = {
    "1g": Scenario("1g", "32 MiB / 64 tensors (quick)", 64, 32 * MiB),
    "20k": Scenario("20k", "4 MiB / 500 tensors (quick)", 500, 4 * MiB),
    "lora": Scenario("lora", LORA_LABEL.format("32 MiB") + " (quick)", 112, 32 * MiB, "lora"),
}


# =========================================================================== worker side


def spin(seconds: float) -> int:
    """A pure-Python loop standing in for training work: iterations done in ``seconds``."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            n += 1
    return n


def make_state(sc: Scenario) -> dict[str, Any]:
    import torch

    numel = sc.nbytes // sc.tensors // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer{i:05d}.weight": torch.rand(numel, generator=g) for i in range(sc.tensors)}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def memory_phases(r: dict[str, Any]) -> dict[str, float]:
    """aiockpt's trainer peak RSS above its RSS once the state was made, ÷ the state's bytes,
    per phase measured apart."""
    base, state = r.get("state_rss_mib"), r.get("state_mib")
    if not base or not state:
        return {}
    out = {}
    if r.get("save_peak_rss_mib"):
        out["saving"] = (r["save_peak_rss_mib"] - base) / state
    for key, name in (
        ("aiockpt_into_existing", "load(into=state) with the run's slab"),
        ("aiockpt_fresh", "load() with the run's slab"),
    ):
        peak = r.get("load", {}).get(key, {}).get("peak_rss_mib")
        if peak:
            out[name] = (peak - base) / state
    if r.get("resume_load_peak_rss_mib"):
        out["load() resuming"] = (r["resume_load_peak_rss_mib"] - base) / state
    return out


def vm_hwm_mib() -> float:
    """This process's peak RSS since it started or since the last :func:`reset_hwm`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def reset_hwm() -> None:
    """Start the peak RSS afresh from the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def helpers_peak_mib() -> float:
    """Sum of the peak RSS (VmHWM) of this process's live descendants."""
    import psutil

    total = 0.0
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(OSError, psutil.Error), open(f"/proc/{p.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
    return total


def drop_cache(paths: list[str], mode: str) -> str:
    """Evict the page cache of ``paths`` (files or directories); says how it was done."""
    if mode == "warm":
        return "warm (not dropped)"
    os.sync()
    if mode == "global":
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
            return "dropped (drop_caches)"
        except OSError:
            pass  # not root: evict just these files below
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            files += [os.path.join(d, n) for d, _, names in os.walk(p) for n in names]
        else:
            files.append(p)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "dropped (fadvise DONTNEED on the files)"


class Sampler:
    """Collects one measured save: stall, durable, CPU share and loop rate."""

    def __init__(self, idle_rate: float) -> None:
        self.idle_rate = idle_rate
        self.rows: list[dict[str, float | None]] = []

    def blocking(self, fn: Callable[[], None], durable: bool = True) -> None:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        self.rows.append(
            {"stall": dt, "durable": dt if durable else None, "cpu_share": None, "loop_rate": None}
        )

    def background(self, stall: float, t0: float, cpu0: float, w0: float, iters: int) -> None:
        now = time.perf_counter()
        wall = max(now - w0, 1e-9)
        self.rows.append(
            {
                "stall": stall,
                "durable": now - t0,
                "cpu_share": (time.thread_time() - cpu0) / wall,
                "loop_rate": iters / wall / self.idle_rate,
            }
        )

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"runs": self.rows}
        for k in ("stall", "durable", "cpu_share", "loop_rate"):
            vals = [r[k] for r in self.rows if r[k] is not None]
            out[k] = statistics.median(vals) if vals else None
            if k in ("stall", "durable"):
                out[f"{k}_best"] = min(vals) if vals else None
        return out


def raw_read(path: str, buf: Any) -> None:
    """The floor of a load: one buffered read of the whole file ``path`` into ``buf`` (a uint8
    tensor, faulted in beforehand, like the tensors ``load(into=...)`` copies into)."""
    mv = memoryview(buf.numpy())
    with open(path, "rb", buffering=0) as f:
        n = 0
        while n < len(mv):
            got = f.readinto(mv[n:])
            if not got:
                break
            n += got


def timed(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None) -> dict:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median": statistics.median(times), "best": min(times), "runs": times}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def work_memcpy(sc: Scenario, state: dict, d: str, reps: int, smp: Sampler, cache: str) -> dict:
    import torch

    src = torch.cat(list(state.values())).view(torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: faults the destination in
    for _ in range(reps):
        smp.blocking(lambda: dst.copy_(src), durable=False)
    return {}


def work_write_fsync(sc: Scenario, state: dict, d: str, reps: int, smp: Sampler, cache: str):
    import torch

    data = memoryview(torch.cat(list(state.values())).view(torch.uint8).numpy())

    def write(i: int) -> None:
        with open(os.path.join(d, f"raw-{i}.bin"), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    write(0)
    for i in range(1, reps + 1):
        os.unlink(os.path.join(d, f"raw-{i - 1}.bin"))
        smp.blocking(lambda i=i: write(i))
    return {}


def work_torch_save(sc: Scenario, state: dict, d: str, reps: int, smp: Sampler, cache: str):
    import torch

    def save(i: int) -> None:
        with open(os.path.join(d, f"ckpt-{i}.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    save(0)
    for i in range(1, reps + 1):
        os.unlink(os.path.join(d, f"ckpt-{i - 1}.pt"))
        smp.blocking(lambda i=i: save(i))
    path = os.path.join(d, f"ckpt-{reps}.pt")
    how = []
    load = timed(
        lambda: torch.load(path, weights_only=True),
        reps,
        before=lambda: how.append(drop_cache([path], cache)),
    )
    return {"load": {"torch_load": load}, "cache": how[-1]}


def _dcp(kind: str):
    def work(sc: Scenario, state: dict, d: str, reps: int, smp: Sampler, cache: str) -> dict:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
        typ = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
        try:

            def start(i: int):
                return dcp.async_save(
                    state, checkpoint_id=os.path.join(d, f"dcp-{i}"), async_checkpointer_type=typ
                )

            start(0).result()  # warm-up (starts the process executor's worker)
            for i in range(1, reps + 1):
                shutil.rmtree(os.path.join(d, f"dcp-{i - 1}"))
                t0 = time.perf_counter()
                fut = start(i)
                stall = time.perf_counter() - t0
                cpu0, w0, iters = time.thread_time(), time.perf_counter(), 0
                while not fut.done():
                    iters += spin(0.002)
                fut.result()
                smp.background(stall, t0, cpu0, w0, iters)
                for t in state.values():  # the trainer moves on
                    t.add_(1.0)
            helpers = helpers_peak_mib()
            out: dict[str, Any] = {"helpers_peak_rss_mib": helpers}
            if kind == "thread":
                path = os.path.join(d, f"dcp-{reps}")
                how = []
                out["load"] = {
                    "dcp_load": timed(
                        lambda: dcp.load(state, checkpoint_id=path),
                        reps,
                        before=lambda: how.append(drop_cache([path], cache)),
                    )
                }
                out["cache"] = how[-1]
            return out
        finally:
            dist.destroy_process_group()

    return work


def work_aiockpt(
    sc: Scenario,
    state: dict,
    d: str,
    reps: int,
    smp: Sampler,
    cache: str,
    dedup: bool = True,
    skip_unchanged: bool = False,
) -> dict:
    import anyio
    import torch

    sys.path.insert(0, str(REPO))
    from aiockpt import AsyncCheckpointManager

    out: dict[str, Any] = {}

    async def main() -> None:
        root = os.path.join(d, "aiockpt")
        async with AsyncCheckpointManager(root, dedup=dedup, skip_unchanged=skip_unchanged) as mgr:
            await (await mgr.save(0, state))  # warm-up: slab allocated, layout cached
            for step in range(1, reps + 1):
                # The trainer moves on before every save, the first measured one included:
                # nothing repeats, so no save refers to the one before (incremental
                # checkpoints are measured in the lora scenario).
                for t in state.values():
                    t.add_(1.0)
                t0 = time.perf_counter()
                handle = await mgr.save(step, state)
                stall = time.perf_counter() - t0
                cpu0, w0, iters = time.thread_time(), time.perf_counter(), 0
                while not handle.done():
                    iters += spin(0.002)
                    await anyio.sleep(0)  # lets the manager's reader task see the commit
                await handle
                smp.background(stall, t0, cpu0, w0, iters)
            out["helpers_peak_rss_mib"] = helpers_peak_mib()
            out["save_peak_rss_mib"] = vm_hwm_mib()  # the save phase's peak, on its own
            if not dedup:
                return  # the loads are aiockpt's, measured once

            shard = os.path.join(root, f"step_{reps:012d}", "shard_r00000.safetensors")
            raw = [torch.empty(os.path.getsize(shard), dtype=torch.uint8)]
            raw[0].fill_(0)  # faulted in, like the tensors load(into=...) copies into
            how: list[str] = []

            def drop() -> None:
                how.append(drop_cache([shard], cache))

            loads: dict[str, Any] = {"raw_read": timed(lambda: raw_read(shard, raw[0]), reps, drop)}
            raw.clear()  # the raw read's buffer is not the loads' memory
            for name, kwargs in (("into_existing", {"into": state}), ("fresh", {})):
                times = []
                reset_hwm()  # the peak of each kind of load, measured apart
                for _ in range(reps):
                    drop()
                    t1 = time.perf_counter()
                    result = await mgr.load(reps, **kwargs)
                    times.append(time.perf_counter() - t1)
                    del result
                loads[f"aiockpt_{name}"] = {
                    "median": statistics.median(times),
                    "best": min(times),
                    "runs": times,
                    "peak_rss_mib": vm_hwm_mib(),
                }
            out["load"] = loads
            out["cache"] = how[-1]
        # A resumed run: load() by a manager that has staged nothing (the saving one closed,
        # its slabs gone), the peak taken from there.
        reset_hwm()
        async with AsyncCheckpointManager(root, read_only=True) as resumed:
            result = await resumed.load(reps)
            out["resume_load_peak_rss_mib"] = vm_hwm_mib()
            del result

    anyio.run(main)
    return out


WORKERS: dict[str, Callable[..., dict]] = {
    "memcpy": work_memcpy,
    "write_fsync": work_write_fsync,
    "torch_save": work_torch_save,
    "dcp_thread": _dcp("thread"),
    "dcp_process": _dcp("process"),
    "aiockpt": work_aiockpt,
    "aiockpt_nodedup": lambda *a: work_aiockpt(*a, dedup=False),
    "aiockpt_skip": lambda *a: work_aiockpt(*a, skip_unchanged=True),
}


def worker_main(args: argparse.Namespace) -> None:
    sc = Scenario(**json.loads(args.worker_scenario))
    if sc.kind == "lora":
        idle = spin(args.idle) / args.idle
        os.makedirs(args.dir, exist_ok=True)
        extra = lora_bench.work(args.worker, sc.nbytes, args.dir, args.repeats, idle)
        result = {**extra, "peak_rss_mib": peak_rss_mib(), "idle_rate": idle}
        Path(args.worker_out).write_text(json.dumps(result))
        return
    state = make_state(sc)
    base_rss = rss_mib()
    # The loop's idle rate, before and after: on a shared machine a single window is noisy,
    # and the faster of the two is the closer to what the loop can do undisturbed.
    idle = spin(args.idle) / args.idle
    smp = Sampler(idle)
    os.makedirs(args.dir, exist_ok=True)
    extra = WORKERS[args.worker](sc, state, args.dir, args.repeats, smp, args.cache)
    after = spin(args.idle) / args.idle
    if after > idle:
        for row in smp.rows:
            if row["loop_rate"] is not None:
                row["loop_rate"] *= idle / after
        idle = after
    result = {
        **smp.summary(),
        **extra,
        "state_rss_mib": base_rss,
        "state_mib": sum(t.nbytes for t in state.values()) / MiB,
        "peak_rss_mib": peak_rss_mib(),
        "idle_rate": idle,
    }
    Path(args.worker_out).write_text(json.dumps(result))


# =========================================================================== driver side


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


#: Rough peak memory of a contender, in multiples of the state: the state plus its copies
#: (a staged copy, a slab, DCP's copy in its worker process), with room to spare.
MEM_FACTOR = {
    "memcpy": 2.2,
    "write_fsync": 2.2,
    "write_fsync_changed": 2.2,
    "torch_save": 1.5,
    "aiockpt": 2.5,
    "aiockpt_nodedup": 2.5,
    "aiockpt_skip": 2.5,
}
MEM_FACTOR_DEFAULT = 3.5


def run_contender(
    name: str, sc: Scenario, args: argparse.Namespace, scratch: str
) -> dict[str, Any]:
    need = int(sc.nbytes * MEM_FACTOR.get(name, MEM_FACTOR_DEFAULT)) + GiB
    if mem_available() < need:
        return {
            "status": "skipped",
            "why": f"needs ~{need / GiB:.1f} GiB, {mem_available() / GiB:.1f} GiB available",
        }
    d = os.path.join(scratch, f"{sc.key}-{name}")
    out = os.path.join(scratch, f"{sc.key}-{name}.json")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        name,
        "--worker-scenario",
        json.dumps(asdict(sc)),
        "--worker-out",
        out,
        "--dir",
        d,
        "--repeats",
        str(args.repeats),
        "--cache",
        args.cache,
        "--idle",
        str(args.idle),
    ]
    # lora: the limit is per round of 10 saves.
    limit = args.timeout * (args.repeats if sc.kind == "lora" else 1)
    t0 = time.monotonic()
    # Own session: on a timeout the whole group goes (DCP's worker, aiockpt's daemon).
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=limit)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        status = "timeout"
    finally:
        shutil.rmtree(d, ignore_errors=True)
    elapsed = time.monotonic() - t0
    if status == "ok":
        result = json.loads(Path(out).read_text())
        result.update(status="ok", elapsed_s=elapsed)
        return result
    why = (
        f"exceeded the {limit:.0f} s limit"
        if status == "timeout"
        else f"exit code {proc.returncode}: {last_error(log.decode(errors='replace'))}"
    )
    return {"status": status, "why": why, "elapsed_s": elapsed}


def last_error(log: str) -> str:
    """The last exception line of a worker's output, without machine-specific paths."""
    lines = [ln.split("]:", 1)[-1].strip() for ln in log.strip().splitlines()]
    errors = [ln for ln in lines if re.match(r"[\w.]+(Error|Exception)\b", ln)]
    text = (errors or lines or ["no output"])[-1]
    for prefix in (str(REPO), sys.prefix, tempfile.gettempdir()):
        text = text.replace(prefix, "…")
    return text[:300]


def machine_info() -> dict[str, Any]:
    import torch

    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def fs_type(path: str) -> str:
    best, kind = "", "unknown"
    path = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            dev, mnt, typ = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, f"{typ} on {dev}"
    return kind


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(res: dict[str, dict[str, dict]]) -> list[dict[str, Any]]:
    """The issue's targets for aiockpt, as ratios measured in this run."""

    def get(sc: str, c: str, k: str) -> float | None:
        r = res.get(sc, {}).get(c, {})
        return r.get(k) if r.get("status") == "ok" else None

    def load(sc: str, k: str) -> float | None:
        r = res.get(sc, {}).get("aiockpt", {})
        return r.get("load", {}).get(k, {}).get("median") if r.get("status") == "ok" else None

    rows: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, higher: bool = False, note: str = ""):
        met = None if value is None else (value >= limit if higher else value <= limit)
        rows.append(
            {
                "target": name,
                "value": value,
                "limit": limit,
                "higher_is_better": higher,
                "met": met,
                "note": note,
            }
        )

    ours = {k: get("1g", "aiockpt", k) for k in ("stall", "durable")}
    add("stall / memcpy at 1 GiB", ratio(ours["stall"], get("1g", "memcpy", "stall")), 1.3)
    raw = get("1g", "write_fsync", "durable")
    add("durable / write+fsync at 1 GiB", ratio(ours["durable"], raw), 1.0)
    for sc, limit in (("1g", 5.0), ("20k", 50.0)):
        dcp = res.get(sc, {}).get("dcp_process", {})
        value = ratio(get(sc, "dcp_process", "durable"), get(sc, "aiockpt", "durable"))
        note = ""
        if value is None and dcp.get("status") in ("timeout", "failed"):
            note = f"DCP process executor {dcp['status']}: {dcp.get('why', '')}"[:200]
        add(f"DCP process durable / aiockpt durable at {sc}", value, limit, True, note)
    for sc in res:
        share = get(sc, "aiockpt", "cpu_share")
        others = [
            get(sc, c, "cpu_share")
            for c in ("dcp_thread", "dcp_process")
            if get(sc, c, "cpu_share")
        ]
        add(f"trainer CPU share at {sc}", share, 0.95, True)
        if share is not None and others:
            margin = share - max(others)
            add(f"CPU share above every contender at {sc} (margin)", margin, 0.0, True)
    into = ratio(load("1g", "aiockpt_into_existing"), load("1g", "raw_read"))
    add("load into existing / raw read at 1 GiB", into, 1.3)
    big = ratio(get("4g", "aiockpt", "stall"), ours["stall"])
    add("stall at 4 GiB / stall at 1 GiB", big, 4.4)
    r4 = res.get("4g", {}).get("aiockpt", {})
    phases = memory_phases(r4) if r4.get("status") == "ok" else {}
    add("4 GiB: trainer peak RSS - state, saving / state", phases.get("saving"), 1.15)
    add(
        "4 GiB: trainer peak RSS - state, load() resuming / state",
        phases.get("load() resuming"),
        1.15,
    )
    lora_bench.targets(res, add)
    return rows


def fmt_s(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"


def fmt_f(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    lines = []
    for sc in report["scenarios"].values():
        if sc.get("kind") == "lora":
            lines += lora_bench.markdown(sc, LABELS)
            continue
        lines += [
            f"**{sc['label']}**",
            "",
            "| contender | stall | durable | trainer CPU share | loop rate | peak RSS trainer "
            "| peak RSS helpers |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for c, r in sc["contenders"].items():
            if r["status"] != "ok":
                why = r["why"].replace("<", "&lt;")  # an error text is not HTML
                lines.append(f"| {LABELS[c]} | {r['status']}: {why} ||||||")
                continue
            helpers = r.get("helpers_peak_rss_mib")
            lines.append(
                f"| {LABELS[c]} | {fmt_s(r['stall'])} | {fmt_s(r['durable'])} "
                f"| {fmt_f(r['cpu_share'])} | {fmt_f(r['loop_rate'])} "
                f"| {r['peak_rss_mib']:.0f} MiB | "
                f"{'–' if not helpers else f'{helpers:.0f} MiB'} |"
            )
        loads = {}
        for r in sc["contenders"].values():
            loads.update(r.get("load", {}) if r["status"] == "ok" else {})
        if loads:
            names = {
                "raw_read": "raw read of the shard file",
                "aiockpt_into_existing": "aiockpt load(into=state)",
                "aiockpt_fresh": "aiockpt load()",
                "torch_load": "torch.load",
                "dcp_load": "DCP load (in place)",
            }
            lines += ["", "| load | time |", "|---|---:|"]
            lines += [f"| {names[k]} | {fmt_s(v['median'])} |" for k, v in loads.items()]
        ours = sc["contenders"].get("aiockpt", {})
        phases = memory_phases(ours) if ours.get("status") == "ok" else {}
        if phases:
            lines += [
                "",
                "aiockpt trainer, peak RSS minus the state, ÷ the state, by phase: "
                + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
                + ".",
            ]
        lines.append("")
    lines += ["**Targets for aiockpt (ratios in this run)**", "", "| target | value | limit | |"]
    lines.append("|---|---:|---:|---|")
    for t in report["targets"]:
        mark = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        sign = "≥" if t["higher_is_better"] else "≤"
        note = f" ({t['note']})".replace("<", "&lt;") if t["note"] else ""
        digits = 3 if "margin" in t["target"] else 2
        lines.append(
            f"| {t['target']} | {fmt_f(t['value'], digits)} | {sign} {t['limit']:g} "
            f"| {mark}{note} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scs = list(report["scenarios"].values())
    fig, axes = plt.subplots(1, len(scs), figsize=(4.2 * len(scs), 4.0), squeeze=False)
    for ax, sc in zip(axes[0], scs, strict=True):
        names = list(sc["contenders"])
        xs = range(len(names))
        stall = [r["stall"] if r["status"] == "ok" else 0 for r in sc["contenders"].values()]
        durable = [
            (r["durable"] or 0) if r["status"] == "ok" else 0 for r in sc["contenders"].values()
        ]
        w = 0.4
        ax.bar([x - w / 2 for x in xs], stall, w, label="stall", color="#d62728")
        ax.bar([x + w / 2 for x in xs], durable, w, label="until durable", color="#1f77b4")
        for x, r in zip(xs, sc["contenders"].values(), strict=True):
            if r["status"] != "ok":
                ax.text(x, 1e-3, r["status"], rotation=90, ha="center", va="bottom", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylim(bottom=1e-3)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([LABELS[n] for n in names], rotation=40, ha="right", fontsize=8)
        ax.set_title(sc["label"], fontsize=10)
        ax.set_ylabel("seconds (log)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def update_doc_page(doc: str, table: str) -> None:
    """Replace the results region of the performance page with this run's table."""
    start, end = "<!-- results:start -->", "<!-- results:end -->"
    text = Path(doc).read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{doc} has no {start} … {end} region to update")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    Path(doc).write_text(f"{head}{start}\n{table}{end}{tail}")


def publish(report: dict[str, Any], out_dir: Path, update_doc: str | None) -> None:
    """Print the table; write the JSON and the plot; optionally update the docs page."""
    res = {k: v["contenders"] for k, v in report["scenarios"].items()}
    report["targets"] = targets(res)
    md = markdown(report)
    print()
    print(md)
    caches = report["config"].get("page_cache_before_loads") or ["no loads measured"]
    print(f"page cache before loads: {', '.join(caches)}")
    json_path = out_dir / "performance.json"
    png_path = out_dir / "performance.png"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, str(png_path))
    print(f"wrote {json_path} and {png_path}")
    if update_doc:
        update_doc_page(update_doc, md)
        print(f"updated {update_doc}")


def driver_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.render:
        # Re-render a finished run (table, plot, page) without measuring again.
        report = json.loads(Path(args.render).read_text())
        out_dir = Path(args.out_dir or Path(args.render).parent)
        publish(report, out_dir, args.update_doc)
        return
    table = QUICK if args.quick else SCENARIOS
    # lora runs when asked for: its section of the docs is not the results region.
    keys = args.scenarios.split(",") if args.scenarios else [k for k in table if k != "lora"]
    reshard = "reshard" in keys  # DTensor resharding: real ranks of its own, reshard_bench.py
    keys = [k for k in keys if k != "reshard"]
    contenders = args.contenders.split(",") if args.contenders else list(CONTENDERS)
    for k in keys:
        if k not in table:
            parser.error(f"unknown scenario {k!r}; choose from {', '.join(table)}, reshard")
    for c in contenders:
        if c not in CONTENDERS:
            parser.error(f"unknown contender {c!r}; choose from {', '.join(CONTENDERS)}")
    out_dir = Path(args.out_dir or (REPO / ("bench-data" if args.quick else "docs")))
    out_dir.mkdir(parents=True, exist_ok=True)
    base = Path(args.dir or REPO / "bench-data")
    base.mkdir(parents=True, exist_ok=True)
    if reshard:
        import reshard_bench

        reshard_bench.run(args, out_dir, base)
        if not keys:
            return
    report: dict[str, Any] = {
        "machine": machine_info(),
        "config": {
            "quick": args.quick,
            "repeats": args.repeats,
            "timeout_s": args.timeout,
            "filesystem": fs_type(str(base)),
            "cache": args.cache,
        },
        "scenarios": {},
    }
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=base, prefix="compare-") as scratch:
        for k in keys:
            sc = table[k]
            if args.size_mib:
                label = (
                    LORA_LABEL.format(f"{args.size_mib} MiB")
                    if sc.kind == "lora"
                    else f"{args.size_mib} MiB / {sc.tensors} tensors"
                )
                sc = Scenario(k, label, sc.tensors, args.size_mib * MiB, sc.kind)
            entry = {"label": sc.label, "nbytes": sc.nbytes, "tensors": sc.tensors, "kind": sc.kind}
            entry["contenders"] = {}
            report["scenarios"][k] = entry
            # Without --contenders, each scenario's own set; with it, those that apply.
            mine = [c for c in contenders if (sc.applies(c) if args.contenders else sc.default(c))]
            # lora: one round of each contender in turn, --repeats times, so that a machine
            # whose speed drifts (a shared one) weighs on every contender alike.
            rounds = args.repeats if sc.kind == "lora" else 1
            one = argparse.Namespace(**{**vars(args), "repeats": 1}) if rounds > 1 else args
            runs: dict[str, list[dict[str, Any]]] = {c: [] for c in mine}
            for i in range(rounds):
                for c in mine:
                    tag = f" (round {i + 1}/{rounds})" if rounds > 1 else ""
                    print(f"  {sc.label:<28} {LABELS[c] + tag:<22}", end="", flush=True)
                    r = run_contender(c, sc, one, scratch)
                    runs[c].append(r)
                    if r["status"] == "ok":
                        print(f" stall {fmt_s(r['stall']):>8}  durable {fmt_s(r['durable']):>8}")
                    else:
                        print(f" {r['status']}: {r['why'][:120]}")
            for c in mine:
                r = runs[c][0] if rounds == 1 else lora_bench.merge(runs[c])
                entry["contenders"][c] = r
    report["elapsed_s"] = time.monotonic() - t_start
    caches = {
        r["cache"]
        for sc in report["scenarios"].values()
        for r in sc["contenders"].values()
        if r.get("cache")
    }
    report["config"]["page_cache_before_loads"] = sorted(caches)
    print(f"measured in {report['elapsed_s']:.0f} s")
    publish(report, out_dir, args.update_doc)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small sizes, 1 repeat: under a minute")
    p.add_argument(
        "--scenarios",
        default=None,
        help="comma-separated: 1g,20k,4g (default), lora, reshard",
    )
    p.add_argument(
        "--contenders",
        default=None,
        help=f"comma-separated, of {','.join(CONTENDERS)}; each scenario runs those that "
        "apply to it (default: all that apply; in lora all but dcp_thread)",
    )
    p.add_argument("--repeats", type=int, default=None, help="measured saves per contender")
    p.add_argument("--size-mib", type=int, default=None, help="override every scenario's size")
    p.add_argument("--timeout", type=float, default=None, help="seconds per contender")
    p.add_argument("--dir", default=None, help="where checkpoints are written (bench-data/)")
    p.add_argument("--out-dir", default=None, help="JSON and PNG go here (docs/, or bench-data/)")
    p.add_argument(
        "--cache",
        choices=("global", "files", "warm"),
        default="global",
        help="before each load: drop_caches (falls back to evicting the files when not root), "
        "evict only the checkpoint's files, or leave the page cache warm",
    )
    p.add_argument("--idle", type=float, default=None, help="idle window for the loop rate, s")
    p.add_argument("--update-doc", default=None, help="rewrite this page's results region")
    p.add_argument("--render", default=None, help="re-render this JSON of a finished run")
    # Internal: one contender in this process.
    p.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--worker-scenario", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.timeout is None:
        args.timeout = 25.0 if args.quick else 300.0
    if args.idle is None:
        args.idle = 0.1 if args.quick else 0.5
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.worker:
        worker_main(args)
    else:
        driver_main(args, p)


if __name__ == "__main__":  # the guard DCP's process executor needs: it spawns and re-imports
    main()
