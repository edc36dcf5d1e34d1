"""One rank of a load_safetensors test: ``_hfimport_worker.py SCENARIO RANK WORLD STORE ROOT
OUT ARGS``. ARGS names the safetensors ``source`` (a ``counted://`` URL) and the ``log`` folder
where each rank's reads are counted (see _support/counted.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from _support.counted import ENV, open_counted, read_totals
from _support.ranks import TESTS, serve_rank
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from aiockpt import AsyncCheckpointManager
from aiockpt.storage import register_storage


def fsdp_model(world: int) -> torch.nn.Module:
    """An MLP whose layers FSDP2 shards on dim 0: 4096 rows (even), then 5 (uneven: 3 + 2 on
    2 ranks, 2 + 2 + 1 + 0 on 4)."""
    torch.manual_seed(100)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 5)
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tp_model(world: int) -> torch.nn.Module:
    """The same MLP, tensor parallel: the first layer by columns (weight Shard(0)), the second
    by rows (weight Shard(1): each rank's piece is strided in the file)."""
    torch.manual_seed(200)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 5)
    )
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def local_bytes(model: torch.nn.Module) -> int:
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.state_dict().values()
    )


def full(model: torch.nn.Module) -> dict[str, list]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).tolist()
        for k, v in model.state_dict().items()
    }


async def load_all(rank: int, world: int, root: str, args: dict) -> dict:
    tests = str(TESTS)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    register_storage("counted", open_counted)
    log = Path(args["log"]) / f"{world}-{rank}.log"
    os.environ[ENV] = str(log)  # before the daemon starts: it inherits it
    out: dict = {}
    async with AsyncCheckpointManager(root, process_group=torch.distributed.group.WORLD) as mgr:
        for name, make in (("fsdp", fsdp_model), ("tp", tp_model)):
            model = make(world)
            before = read_totals(log)
            await mgr.load_safetensors(args["source"], into=model)
            after = read_totals(log)
            out[name] = {"full": full(model), "needed": local_bytes(model)}
            out[name]["read"] = {k: after[k] - before[k] for k in after}
        plain = await mgr.load_safetensors(args["source"])
        out["plain"] = {k: v.tolist() for k, v in plain.items()}
    return out


if __name__ == "__main__":
    serve_rank({"load_all": load_all})
