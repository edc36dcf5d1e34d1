"""One rank of an export test: ``python _export_worker.py SCENARIO RANK WORLD STORE ROOT OUT ARGS``.

Saves an FSDP2 model (uneven rows on 2 ranks), its optimizer, and tensor-parallel style
tensors at step 1, and writes the full values of everything it saved to OUT as JSON, for the
test to compare an export with.
"""

from __future__ import annotations

import torch
from _support.ranks import serve_rank
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from aiockpt import AsyncCheckpointManager


def model() -> torch.nn.Module:
    """The model every test builds: 5 output rows, uneven on 2 ranks (3 + 2)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def extra(world: int) -> dict[str, torch.Tensor]:
    """Tensors beside the model: a Shard(1) DTensor (7 columns, 4 + 3 on 2 ranks), an int64
    Shard(0) one, and plain tensors that every rank saves alike (bf16, and one of no bytes)."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    return {
        "cols": distribute_tensor(torch.randn(3, 7, generator=g), mesh, [Shard(1)]),
        "ids": distribute_tensor(torch.arange(9, dtype=torch.int64), mesh, [Shard(0)]),
        "half": torch.linspace(0, 1, 6).to(torch.bfloat16),
        "none": torch.zeros(0, 3),
    }


def full(t: torch.Tensor) -> dict:
    whole = t.full_tensor() if isinstance(t, DTensor) else t
    return {"dtype": str(whole.dtype), "values": whole.float().tolist()}


async def save(rank: int, world: int, root: str, args: dict) -> dict:
    net = model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    state = {"model": net, "optim": opt, "extra": extra(world), "step": 1}
    if args.get("per_rank"):
        state["rng"] = torch.full((2,), float(rank))  # differs between ranks
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(1, state))
    optim = opt.state_dict()["state"]
    return {
        "model": {k: full(v) for k, v in net.state_dict().items()},
        "extra": {k: full(v) for k, v in state["extra"].items()},
        "optim": {f"state/{i}/{k}": full(v) for i, st in optim.items() for k, v in st.items()},
    }


SCENARIOS = {"save": save}


if __name__ == "__main__":
    serve_rank(SCENARIOS)
