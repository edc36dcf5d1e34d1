"""The ``lora`` scenario of compare.py: incremental checkpoints of a mostly frozen state.

The state is what ``get_state_dict(model, optimizer)`` gives for a LoRA fine-tune: a frozen
base of 16 linear weights (4096 x 4096 float32, 64 MiB each, 1 GiB in all), each followed in
state order by its trainable adapters (``lora_A`` 64 x 4096 and ``lora_B`` 4096 x 64, rank
64: 32 MiB in all), and AdamW's state for the adapters only (``step``, ``exp_avg``,
``exp_avg_sq`` per adapter, keyed by parameter name, and the param group). Between two saves
an AdamW step changes the adapters and both moments in place, every element of them; the
base never changes. The changed bytes per save are the adapters' and the moments' (96 MiB).

Each contender runs ``--repeats`` rounds in one fresh process; a round is 10 saves to a fresh
directory (the first writes everything; it is reported on its own), the state stepped before
each save after the first. Per round: the mean of saves 2-10; reported: the median over the
rounds. Figures: stall (until the save call returns), durable (until fsynced / committed),
bytes written per save (aiockpt: ``written_nbytes`` of its ``save.written`` events; the
others: the size of the files the save made). aiockpt also saves once more after a restart
(a new manager on the same root: its first save knows no samples, so it hashes every block
that could match before writing it).

The floor, *write+fsync (changed bytes)*: a plain buffered write of the adapters' and the
moments' bytes to a fresh file, then fsync: no save of the changes can be durable sooner.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20

#: Saves per round: the first writes everything, the other nine only what changed.
SAVES = 10
LAYERS = 16
#: Contenders that make sense here; dcp_thread only when asked for (about 5 s a save).
APPLIES = (
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
DEFAULT = tuple(c for c in APPLIES if c != "dcp_thread")


def shape(frozen_nbytes: int) -> tuple[int, int]:
    """(d, rank) for 16 d x d float32 base weights of ``frozen_nbytes`` in all: rank d / 64,
    so the adapters are 1/32 of the base, as 32 MiB are of 1 GiB."""
    d = max(64, int(math.sqrt(frozen_nbytes / LAYERS / 4)) // 64 * 64)
    return d, d // 64


def make_state(frozen_nbytes: int) -> dict[str, Any]:
    import torch

    d, r = shape(frozen_nbytes)
    g = torch.Generator().manual_seed(0)
    model: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    for i in range(LAYERS):
        model[f"layers.{i}.weight"] = torch.rand(d, d, generator=g)
        for name, shp in (("lora_A", (r, d)), ("lora_B", (d, r))):
            key = f"layers.{i}.{name}.weight"
            model[key] = torch.rand(shp, generator=g) * 0.01
            optim_state[key] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros(shp),
                "exp_avg_sq": torch.zeros(shp),
            }
    param_group = {
        "lr": 1e-4,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.01,
        "params": list(optim_state),
    }
    state = {"model": model, "optim": {"state": optim_state, "param_groups": [param_group]}}
    adamw_step(state)  # moments with values, as after the first step of training
    return state


def adamw_step(state: dict[str, Any]) -> None:
    """One AdamW step on the adapters, in place: every element of them and of their moments
    changes; the base does not."""
    import torch

    model, optim = state["model"], state["optim"]
    group = optim["param_groups"][0]
    b1, b2 = group["betas"]
    for key, s in optim["state"].items():
        p = model[key]
        grad = torch.randn_like(p)
        s["step"] += 1
        p.mul_(1 - group["lr"] * group["weight_decay"])
        s["exp_avg"].lerp_(grad, 1 - b1)
        s["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = s["exp_avg_sq"].sqrt().add_(group["eps"])
        p.addcdiv_(s["exp_avg"], denom, value=-group["lr"])


def tensors(obj: Any) -> Iterator[Any]:
    """Every tensor of a nested state, in state order."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from tensors(v)


def changed(state: dict[str, Any]) -> list[Any]:
    """The tensors an optimizer step changes: the adapters, their moments and step counts."""
    adapters = [t for k, t in state["model"].items() if ".lora_" in k]
    return adapters + list(tensors(state["optim"]["state"]))


def flat_bytes(ts: list[Any]) -> Any:
    import torch

    return torch.cat([t.reshape(-1).view(torch.uint8) for t in ts])


def du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(path) for n in ns)


# =========================================================================== contenders


class Saver:
    """One contender's saves: ``prepare`` (untimed), ``save`` (the stall; returns a poll for
    completion, or None when the call blocked until durable), ``finish`` (until durable;
    returns the bytes written)."""

    def __init__(self, state: dict[str, Any], d: str) -> None:
        self.state = state
        self.d = d
        self.round_dir = d

    async def open(self, r: int) -> None:
        self.round_dir = os.path.join(self.d, f"round{r}")
        os.makedirs(self.round_dir, exist_ok=True)

    def prepare(self, k: int) -> None:
        pass

    async def save(self, k: int) -> Callable[[], bool] | None:
        raise NotImplementedError

    async def finish(self, k: int) -> int | None:
        return None

    async def close(self) -> dict[str, Any]:
        """Ends a round: its files removed; the helper processes' peak RSS so far."""
        from compare import helpers_peak_mib

        shutil.rmtree(self.round_dir, ignore_errors=True)
        return {"helpers_peak_rss_mib": helpers_peak_mib()}


class Memcpy(Saver):
    """One copy of the state's bytes into a preallocated, faulted-in buffer (the stall floor,
    as in the other scenarios: the source is the state's bytes laid end to end)."""

    async def open(self, r: int) -> None:
        await super().open(r)
        self.dst = flat_bytes(list(tensors(self.state)))  # faulted in

    def prepare(self, k: int) -> None:
        self.src = flat_bytes(list(tensors(self.state)))

    async def save(self, k: int) -> None:
        self.dst.copy_(self.src)


class WriteFsync(Saver):
    """A buffered write + fsync of bytes to a fresh file (the previous one removed first)."""

    only_changed = False

    def prepare(self, k: int) -> None:
        src = changed(self.state) if self.only_changed else list(tensors(self.state))
        self.data = memoryview(flat_bytes(src).numpy())
        self.path = os.path.join(self.round_dir, f"raw-{k}.bin")
        prev = os.path.join(self.round_dir, f"raw-{k - 1}.bin")
        if os.path.exists(prev):
            os.unlink(prev)

    async def save(self, k: int) -> None:
        with open(self.path, "wb") as f:
            f.write(self.data)
            f.flush()
            os.fsync(f.fileno())

    async def finish(self, k: int) -> int:
        return os.path.getsize(self.path)


class WriteFsyncChanged(WriteFsync):
    only_changed = True


class TorchSave(Saver):
    def prepare(self, k: int) -> None:
        self.path = os.path.join(self.round_dir, f"ckpt-{k}.pt")
        prev = os.path.join(self.round_dir, f"ckpt-{k - 1}.pt")
        if os.path.exists(prev):
            os.unlink(prev)

    async def save(self, k: int) -> None:
        import torch

        with open(self.path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())

    async def finish(self, k: int) -> int:
        return os.path.getsize(self.path)


class Dcp(Saver):
    """``torch.distributed.checkpoint.async_save`` on a world-size-1 gloo group; the previous
    checkpoint is removed before each save, as for torch.save."""

    def __init__(self, state: dict[str, Any], d: str, kind: str) -> None:
        super().__init__(state, d)
        self.kind = kind

    def prepare(self, k: int) -> None:
        self.path = os.path.join(self.round_dir, f"dcp-{k}")
        shutil.rmtree(os.path.join(self.round_dir, f"dcp-{k - 1}"), ignore_errors=True)

    async def save(self, k: int) -> Callable[[], bool]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        typ = AsyncCheckpointerType.THREAD
        if self.kind == "process":
            typ = AsyncCheckpointerType.PROCESS
        self.fut = dcp.async_save(self.state, checkpoint_id=self.path, async_checkpointer_type=typ)
        return self.fut.done

    async def finish(self, k: int) -> int:
        self.fut.result()
        return du(self.path)


class Aiockpt(Saver):
    """``await mgr.save(step, state)``, then ``await handle``; the bytes written are the
    ``written_nbytes`` of the save's ``save.written`` event. No retention: every step kept."""

    def __init__(self, state: dict[str, Any], d: str, dedup: bool, skip: bool = False) -> None:
        super().__init__(state, d)
        self.dedup = dedup
        self.skip = skip
        self.written: dict[int, int] = {}

    def on_event(self, event: Any) -> None:
        if event.name == "save.written" and event.written_nbytes is not None:
            self.written[event.step] = self.written.get(event.step, 0) + event.written_nbytes

    async def open(self, r: int) -> None:
        await super().open(r)
        self.written = {}  # every round numbers its steps from 1
        await self.start()

    async def start(self) -> None:
        sys.path.insert(0, str(REPO))
        from aiockpt import AsyncCheckpointManager

        self.mgr = AsyncCheckpointManager(
            os.path.join(self.round_dir, "aiockpt"),
            dedup=self.dedup,
            skip_unchanged=self.skip,
            event_handlers=[self.on_event],
        )
        await self.mgr.__aenter__()

    async def save(self, k: int) -> Callable[[], bool]:
        self.handle = await self.mgr.save(k, self.state)
        return self.handle.done

    async def finish(self, k: int) -> int:
        await self.handle
        return self.written[k]

    async def restart(self) -> None:
        await self.mgr.__aexit__(None, None, None)
        await self.start()

    async def close(self) -> dict[str, Any]:
        from compare import helpers_peak_mib

        peak = helpers_peak_mib()  # while the daemon lives
        await self.mgr.__aexit__(None, None, None)
        await super().close()
        return {"helpers_peak_rss_mib": peak}


# =========================================================================== worker


def work(name: str, frozen_nbytes: int, d: str, rounds: int, idle_rate: float) -> dict:
    """Runs ``rounds`` rounds of SAVES saves of one contender; returns its figures."""
    import anyio
    from compare import spin

    state = make_state(frozen_nbytes)
    changed_nbytes = sum(t.nbytes for t in changed(state))
    total_nbytes = sum(t.nbytes for t in tensors(state))
    dist = None
    if name.startswith("dcp"):
        import torch.distributed as dist
        from compare import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    saver: Saver = {
        "memcpy": lambda: Memcpy(state, d),
        "write_fsync": lambda: WriteFsync(state, d),
        "write_fsync_changed": lambda: WriteFsyncChanged(state, d),
        "torch_save": lambda: TorchSave(state, d),
        "dcp_thread": lambda: Dcp(state, d, "thread"),
        "dcp_process": lambda: Dcp(state, d, "process"),
        "aiockpt": lambda: Aiockpt(state, d, dedup=True),
        "aiockpt_nodedup": lambda: Aiockpt(state, d, dedup=False),
        "aiockpt_skip": lambda: Aiockpt(state, d, dedup=True, skip=True),
    }[name]()

    async def one(k: int) -> dict[str, Any]:
        saver.prepare(k)
        t0 = time.perf_counter()
        poll = await saver.save(k)
        stall = time.perf_counter() - t0
        row: dict[str, Any] = {"stall": stall, "cpu_share": None, "loop_rate": None}
        if poll is not None:
            cpu0, w0, iters = time.thread_time(), time.perf_counter(), 0
            while not poll():
                iters += spin(0.002)
                await anyio.sleep(0)  # lets aiockpt's reader task see the commit
            wall = max(time.perf_counter() - w0, 1e-9)
            row["cpu_share"] = (time.thread_time() - cpu0) / wall
            row["loop_rate"] = iters / wall / idle_rate
        row["written"] = await saver.finish(k)
        # A copy into memory makes nothing durable.
        row["durable"] = None if row["written"] is None else time.perf_counter() - t0
        return row

    rows: list[list[dict[str, Any]]] = []
    restarts: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}

    async def main() -> None:
        for r in range(rounds):
            await saver.open(r)
            this: list[dict[str, Any]] = []
            for k in range(1, SAVES + 1):
                if k > 1:
                    adamw_step(state)
                this.append(await one(k))
            if isinstance(saver, Aiockpt):
                await saver.restart()
                adamw_step(state)
                restarts.append(await one(SAVES + 1))
            extra.update(await saver.close())
            rows.append(this)

    try:
        anyio.run(main)
    finally:
        if dist is not None:
            dist.destroy_process_group()
    return {
        **summarize(rows, restarts),
        **extra,
        "changed_nbytes": changed_nbytes,
        "state_nbytes": total_nbytes,
        "saves": SAVES,
        "rounds": rows,
        "restart_runs": restarts,
    }


def _mean(rows: list[dict[str, Any]], k: str) -> float | None:
    vals = [r[k] for r in rows if r.get(k) is not None]
    return statistics.fmean(vals) if vals else None


def _median(vals: list[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return statistics.median(got) if got else None


def summarize(rows: list[list[dict[str, Any]]], restarts: list[dict[str, Any]]) -> dict:
    """First save: median over rounds; saves 2-10: median over rounds of each round's mean."""
    keys = ("stall", "durable", "written", "cpu_share", "loop_rate")
    out: dict[str, Any] = {}
    for k in keys:
        out[k] = _median([_mean(rnd[1:], k) for rnd in rows])
        out[f"first_{k}"] = _median([rnd[0].get(k) for rnd in rows])
        if restarts:
            out[f"restart_{k}"] = _median([r.get(k) for r in restarts])
    return out


# =========================================================================== driver


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's figures from its rounds run one process each: the first failure, or
    the summary over every round (peaks: the highest)."""
    for r in runs:
        if r["status"] != "ok":
            return r
    rows = [rnd for r in runs for rnd in r["rounds"]]
    restarts = [x for r in runs for x in r["restart_runs"]]
    out = {k: v for k, v in runs[0].items() if k not in ("rounds", "restart_runs")}
    out.update(summarize(rows, restarts))
    for k in ("peak_rss_mib", "helpers_peak_rss_mib"):
        vals = [r[k] for r in runs if r.get(k) is not None]
        out[k] = max(vals) if vals else None
    out["elapsed_s"] = sum(r["elapsed_s"] for r in runs)
    return {**out, "rounds": rows, "restart_runs": restarts}


def fmt_b(n: float | None) -> str:
    if n is None:
        return "–"
    return f"{n / MiB:.0f} MiB" if n < 10 * 1024 * MiB else f"{n / (1024 * MiB):.1f} GiB"


def markdown(sc: dict[str, Any], labels: dict[str, str]) -> list[str]:
    from compare import fmt_f, fmt_s

    ok = {c: r for c, r in sc["contenders"].items() if r["status"] == "ok"}
    any_r = next(iter(ok.values()), {})
    changed_nbytes = any_r.get("changed_nbytes")
    floor = ok.get("write_fsync_changed", {}).get("durable")
    lines = [
        f"**{sc['label']}** (changed per save: {fmt_b(changed_nbytes)}; "
        f"whole state: {fmt_b(any_r.get('state_nbytes'))})",
        "",
        "| contender | first save: stall | durable | written "
        "| saves 2-10: stall | durable | written per save | written ÷ changed "
        "| durable ÷ floor | trainer CPU share | peak RSS trainer | peak RSS helpers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c, r in sc["contenders"].items():
        if r["status"] != "ok":
            why = r["why"].replace("<", "&lt;")
            lines.append(f"| {labels[c]} | {r['status']}: {why} |||||||||||")
            continue
        helpers = r.get("helpers_peak_rss_mib")
        per = r.get("written")
        durable = r["durable"]
        lines.append(
            f"| {labels[c]} | {fmt_s(r['first_stall'])} "
            f"| {fmt_s(r['first_durable'])} "
            f"| {fmt_b(r.get('first_written'))} | {fmt_s(r['stall'])} | {fmt_s(durable)} "
            f"| {fmt_b(per)} | {fmt_f(ratio(per, changed_nbytes))} "
            f"| {fmt_f(ratio(durable, floor))} | {fmt_f(r.get('cpu_share'))} "
            f"| {r['peak_rss_mib']:.0f} MiB | {'–' if not helpers else f'{helpers:.0f} MiB'} |"
        )
    for c in ("aiockpt", "aiockpt_nodedup", "aiockpt_skip"):
        r = ok.get(c, {})
        if r.get("restart_durable") is not None:
            lines += [
                "",
                f"{labels[c]}, one save after a restart (a new manager on the same root, "
                f"the state stepped once more): stall {fmt_s(r['restart_stall'])}, durable "
                f"{fmt_s(r['restart_durable'])}, written {fmt_b(r['restart_written'])}.",
            ]
    lines.append("")
    return lines


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(res: dict[str, dict[str, dict]], add: Callable[..., None]) -> None:
    """The issue's targets for incremental checkpoints, as ratios measured in this run."""

    def get(sc: str, c: str, k: str) -> float | None:
        r = res.get(sc, {}).get(c, {})
        return r.get(k) if r.get("status") == "ok" else None

    if "lora" in res:
        ours = get("lora", "aiockpt", "durable")
        add(
            "lora: aiockpt durable / write+fsync of the changed bytes",
            ratio(ours, get("lora", "write_fsync_changed", "durable")),
            1.5,
        )
        add(
            "lora: bytes written per save / changed bytes",
            ratio(get("lora", "aiockpt", "written"), get("lora", "aiockpt", "changed_nbytes")),
            1.1,
        )
        add(
            "lora: DCP process durable / aiockpt durable",
            ratio(get("lora", "dcp_process", "durable"), ours),
            20.0,
            True,
        )
        skip = get("lora", "aiockpt_skip", "durable")
        add(
            "lora: aiockpt skip_unchanged durable / write+fsync of the changed bytes",
            ratio(skip, get("lora", "write_fsync_changed", "durable")),
            1.5,
        )
        add(
            "lora: DCP process durable / aiockpt skip_unchanged durable",
            ratio(get("lora", "dcp_process", "durable"), skip),
            20.0,
            True,
        )

        add(
            "lora: aiockpt stall / aiockpt (dedup off) stall",
            ratio(get("lora", "aiockpt", "stall"), get("lora", "aiockpt_nodedup", "stall")),
            1.1,
        )
    if "1g" in res:
        add(
            "1g: aiockpt durable / aiockpt (dedup off) durable (hashing, nothing repeats)",
            ratio(get("1g", "aiockpt", "durable"), get("1g", "aiockpt_nodedup", "durable")),
            1.1,
        )
        add(
            "1g: aiockpt stall / aiockpt (dedup off) stall",
            ratio(get("1g", "aiockpt", "stall"), get("1g", "aiockpt_nodedup", "stall")),
            1.1,
        )
