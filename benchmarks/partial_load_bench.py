"""Partial loads: an evaluator's `load(keys=["model"])` against the full load it replaces.

A model and its AdamW state (parameters a third of the bytes, the two moments the rest) are
saved as ``{"model": model, "optim": optimizer}``. The last step is then loaded in one
process, the kinds of load taking turns in each round and the page cache dropped before
each: the whole checkpoint into fresh tensors (`load()`), only the model's weights
(`load(keys=["model"])`), the whole state in place (`load(into=state)`), the model alone in
place (`load(into={"model": model}, strict=False)`), and a raw read of the shard file for
scale. Bytes read are the daemon's own count (the `load.end` event's ``read_nbytes``):

    python benchmarks/partial_load_bench.py --layers 16 --width 2048 --repeats 7
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import anyio
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import raw_read
from dedup_load_bench import drop_cache

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt


def make_state(layers: int, width: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # the moments exist: the state is parameters + exp_avg + exp_avg_sq
    return model, {"model": model, "optim": opt}


async def run(args: argparse.Namespace, root: str) -> tuple[dict[str, list[float]], dict]:
    model, state = make_state(args.layers, args.width)
    model_bytes = sum(p.nbytes for p in model.parameters())
    ends: list[Any] = []
    kinds = {
        "load()": lambda mgr: mgr.load(1),
        'load(keys=["model"])': lambda mgr: mgr.load(1, keys=["model"]),
        "load(into=state)": lambda mgr: mgr.load(1, into=state),
        'load(into={"model": model}, strict=False)': lambda mgr: mgr.load(
            1, into={"model": model}, strict=False
        ),
    }
    times: dict[str, list[float]] = {"raw read of the shard": [], **{k: [] for k in kinds}}
    read: dict[str, int] = {}

    def on_event(e: Any) -> None:
        if e.name == "load.end":
            ends.append(e)

    async with AsyncCheckpointManager(root, event_handlers=[on_event]) as mgr:
        await (await mgr.save(1, state))
        shard = os.path.join(root, fmt.step_dirname(1), fmt.shard_filename(0))
        buf = torch.zeros(os.path.getsize(shard), dtype=torch.uint8)
        for load in kinds.values():  # warm: the manifest parsed, the slab made
            await load(mgr)
        order = list(kinds)
        for i in range(args.repeats):
            drop_cache()
            t0 = time.perf_counter()
            raw_read(shard, buf)
            times["raw read of the shard"].append(time.perf_counter() - t0)
            for kind in order[i % len(order) :] + order[: i % len(order)]:  # each leads in turn
                drop_cache()
                t0 = time.perf_counter()
                result = await kinds[kind](mgr)
                times[kind].append(time.perf_counter() - t0)
                del result
                read[kind] = ends[-1].read_nbytes
    read["raw read of the shard"] = os.path.getsize(shard)
    sizes = {"shard": os.path.getsize(shard), "model": model_bytes}
    return times, {"read": read, "sizes": sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048, help="Linear(width, width) layers")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    # Each strict=False load logs what it left out (the optimizer): expected here, every time.
    logging.getLogger("aiockpt").setLevel(logging.ERROR)
    if not drop_cache():
        print("warning: not root, the page cache is not dropped before each load")
    with tempfile.TemporaryDirectory(prefix="aiockpt-partial-") as root:
        times, info = anyio.run(run, args, root)
    sizes, read = info["sizes"], info["read"]
    mib = 1 << 20
    print(
        f"{args.layers} × Linear({args.width}, {args.width}) + AdamW: shard "
        f"{sizes['shard'] / mib:.0f} MiB, model {sizes['model'] / mib:.0f} MiB; "
        f"medians of {args.repeats}, page cache dropped before each"
    )
    full = {"load()": statistics.median(times["load()"])}
    full["load(into=state)"] = statistics.median(times["load(into=state)"])
    print("| load | median | ÷ the same load of everything | bytes read ÷ model's |")
    print("|---|---:|---:|---:|")
    for kind, ts in times.items():
        m = statistics.median(ts)
        base = full["load(into=state)"] if "into" in kind else full["load()"]
        rel = "–" if kind.startswith("raw") else f"{m / base:.2f}"
        print(f"| {kind} | {m * 1e3:.0f} ms | {rel} | {read[kind] / sizes['model']:.2f} |")


if __name__ == "__main__":
    main()
