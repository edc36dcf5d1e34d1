"""One rank of a DTensor test: ``_dtensor_worker.py SCENARIO RANK WORLD STORE ROOT OUT ARGS``.

Runs a scenario against a real gloo process group and writes what it saw to OUT as JSON.
Every rank computes the loss of the same whole batch, so FSDP's averaged gradients are the
single-process gradients exactly and training is bit-identical on any world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _support.ranks import serve_rank
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from aiockpt import AsyncCheckpointManager


def model_and_optimizer(world: int, *, shard: bool = True):
    torch.manual_seed(0)
    # 5 output rows: uneven on 2 ranks (3 + 2) and on 4 (2 + 2 + 1 + 0).
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    if shard:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def train(model, opt, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def full(t: torch.Tensor) -> list:
    return (t.full_tensor() if isinstance(t, DTensor) else t).tolist()


def moments(opt) -> dict:
    sd = opt.state_dict()["state"]
    return {f"{i}/{k}": full(v) for i, st in sd.items() for k, v in st.items() if k != "step"} | {
        f"{i}/step": float(st["step"]) for i, st in sd.items()
    }


async def fsdp_save(rank: int, world: int, root: str, args: dict) -> dict:
    model, opt = model_and_optimizer(world)
    losses = train(model, opt, range(3))
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(3, {"model": model, "optim": opt, "step": 3}))
    params = {k: full(v) for k, v in model.state_dict().items()}
    return {
        "losses": losses,
        "params": params,
        "moments": moments(opt),
        "after": train(model, opt, range(3, 6)),
    }


async def fsdp_load(rank: int, world: int, root: str, args: dict) -> dict:
    model, opt = model_and_optimizer(world, shard=world > 0 and not args.get("plain"))
    state = {"model": model, "optim": opt, "step": 0}
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await mgr.load(3, into=state)
    params = {k: full(v) for k, v in model.state_dict().items()}
    return {
        "step": state["step"],
        "params": params,
        "moments": moments(opt),
        "after": train(model, opt, range(3, 6)),
    }


def tp_layout(world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    w = torch.randn(6, 10, generator=g)
    return {
        "w": distribute_tensor(w, mesh, [Shard(1)]),  # 10 columns: uneven on 4 (3, 3, 3, 1)
        "rep": distribute_tensor(torch.arange(12.0).view(3, 4), mesh, [Replicate()]),
        "i": distribute_tensor(torch.arange(7, dtype=torch.int64), mesh, [Shard(0)]),
    }


async def layouts_save(rank: int, world: int, root: str, args: dict) -> dict:
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(1, tp_layout(world)))
    return {}


async def fixture_v2(rank: int, world: int, root: str, args: dict) -> dict:
    """The format version 2 fixture: DTensors of three layouts, a plain tensor whose 3 bytes
    put a pad before the first chunk, and a plain value."""
    state = {**tp_layout(world), "plain": torch.arange(3, dtype=torch.int8), "step": 5}
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(5, state, metrics={"loss": 0.25}))
    return {}


async def layouts_load(rank: int, world: int, root: str, args: dict) -> dict:
    """Load the TP layout's tensors into DTensors of other placements."""
    mesh = init_device_mesh("cpu", (world,))
    into = {
        "w": distribute_tensor(torch.zeros(6, 10), mesh, [Shard(0)]),
        "rep": distribute_tensor(torch.zeros(3, 4), mesh, [Shard(1)]),
        "i": torch.zeros(7, dtype=torch.int64),  # a plain tensor gets the whole value
    }
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await mgr.load(1, into=into)
    expect = {k: full(v) for k, v in tp_layout(world).items()}
    return {"got": {k: full(v) for k, v in into.items()}, "expect": expect}


async def fsdp_load_lastdim(rank: int, world: int, root: str, args: dict) -> dict:
    """Load the FSDP run's weights into DTensors sharded on their last dim instead."""
    mesh = init_device_mesh("cpu", (world,))
    model, _ = model_and_optimizer(world, shard=False)
    into = {
        k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(v.dim() - 1)])
        for k, v in model.state_dict().items()
    }
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await mgr.load(3, into={"model": into}, strict=False)  # the optimizer is left out
    return {
        "params": {k: full(v) for k, v in into.items()},
        "local": {k: list(v.to_local().shape) for k, v in into.items()},
    }


def tp_model(world: int):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


async def fsdp_tp_save(rank: int, world: int, root: str, args: dict) -> dict:
    """FSDP over tensor parallel on a (2, world / 2) mesh."""
    model = tp_model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = batch(0)
    x = torch.cat([x, x], dim=1)
    loss = torch.nn.functional.mse_loss(model(x), torch.cat([y, y, y[:, :2]], dim=1))
    loss.backward()
    opt.step()
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(1, {"model": model, "optim": opt}))
    sd = model.state_dict()
    return {
        "params": {k: full(v) for k, v in sd.items()},
        "placements": {k: [repr(p) for p in v.placements] for k, v in sd.items()},
        "moments": moments(opt),
    }


def mixed_tp_model(mesh_shape: list[int]):
    """A model on a (dp, tp) or (pp, dp, tp) mesh whose first layer alone is tensor parallel:
    the second layer's parameters are DTensors of the dp sub-mesh, one copy per tp rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 5))
    names = ("pp", "dp", "tp")[-len(mesh_shape) :]
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
    parallelize_module(model[0], mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt


def mixed_step(model, opt) -> None:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


async def mixed_tp_save(rank: int, world: int, root: str, args: dict) -> dict:
    """FSDP over a model only part of which is tensor parallel, saved on every rank."""
    model, opt = mixed_tp_model(args["mesh"])
    mixed_step(model, opt)
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(1, {"model": model, "optim": opt}))
    sd = model.state_dict()
    return {
        "params": {k: full(v) for k, v in sd.items()},
        "meshes": {k: v.device_mesh.mesh.tolist() for k, v in sd.items()},
        "moments": moments(opt),
    }


async def mixed_tp_load_fsdp(rank: int, world: int, root: str, args: dict) -> dict:
    """Load that checkpoint into the same model sharded by FSDP alone on a 1-D mesh."""
    torch.manual_seed(1)  # other values than the saved ones
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 5))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await mgr.load(1, into={"model": model, "optim": opt})
    return {
        "params": {k: full(v) for k, v in model.state_dict().items()},
        "moments": moments(opt),
    }


async def dcp_save(rank: int, world: int, root: str, args: dict) -> dict:
    """The state dicts of torch.distributed.checkpoint.state_dict, saved as they are."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = model_and_optimizer(world)
    train(model, opt, range(3))
    model_sd, optim_sd = get_state_dict(model, opt)
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(3, {"model": model_sd, "optim": optim_sd}))
    return {"after": train(model, opt, range(3, 6))}


async def dcp_load(rank: int, world: int, root: str, args: dict) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = model_and_optimizer(world)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await mgr.load(3, into=state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"after": train(model, opt, range(3, 6))}


async def outside_group(rank: int, world: int, root: str, args: dict) -> dict:
    """A manager of rank 0 alone, given a DTensor of a mesh over every rank: refused."""
    mesh = init_device_mesh("cpu", (world,))
    alone = dist.new_group([0])  # every rank takes part in making it
    d = DTensor.from_local(torch.ones(2), mesh, [Shard(0)], run_check=False)
    out: dict = {}
    if rank == 0:
        async with AsyncCheckpointManager(root, process_group=alone) as mgr:
            try:
                await (await mgr.save(1, {"d": d}))
                out["error"] = None
            except Exception as e:
                out["error"] = {"type": type(e).__name__, "message": str(e)}
            out["steps"] = await mgr.steps()
    dist.barrier()
    return out


async def bad_loads(rank: int, world: int, root: str, args: dict) -> dict:
    """Targets the TP layout's checkpoint does not fit; each load must fail, target untouched."""
    mesh = init_device_mesh("cpu", (world,))
    cases = {
        "shape": {"w": distribute_tensor(torch.zeros(6, 11), mesh, [Shard(0)])},
        "dtype": {
            "w": distribute_tensor(torch.zeros(6, 10, dtype=torch.float64), mesh, [Shard(0)])
        },
    }
    out = {}
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        for name, into in cases.items():
            try:
                await mgr.load(1, into=into)
                out[name] = None
            except Exception as e:
                out[name] = {"type": type(e).__name__, "message": str(e)}
            out[name + "_untouched"] = bool((into["w"].to_local() == 0).all())
    return out


async def bad_saves(rank: int, world: int, root: str, args: dict) -> dict:
    """States no rank may save; each must fail on every rank with nothing written."""
    from torch.distributed.tensor import Partial

    mesh = init_device_mesh("cpu", (world,))
    # Built with from_local, which runs no collective: distribute_tensor on one rank only
    # would hang the other.
    cases = {
        "partial": {"p": DTensor.from_local(torch.ones(2), mesh, [Partial()])},
        "mixed": {
            "m": DTensor.from_local(torch.ones(2), mesh, [Shard(0)], run_check=False)
            if rank == 0
            else torch.ones(4)
        },
        "shapes": {
            "s": DTensor.from_local(torch.ones(2 + rank), mesh, [Shard(0)], run_check=False)
        },
    }
    out = {}
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        for i, (name, state) in enumerate(cases.items()):
            try:
                await (await mgr.save(i, state))
                out[name] = None
            except Exception as e:
                out[name] = {"type": type(e).__name__, "message": str(e)}
        out["steps"] = await mgr.steps()
    return out


async def dedup_saves(rank: int, world: int, root: str, args: dict) -> dict:
    """Three saves of a frozen sharded table, a replicated one and a small trainable part:
    the bytes each rank wrote per save, and what a load of the last one restored."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(5)
    frozen = distribute_tensor(torch.randn(1024, 512, generator=g), mesh, [Shard(0)])
    shared = distribute_tensor(torch.randn(512, 512, generator=g), mesh, [Replicate()])
    small = distribute_tensor(torch.zeros(8, 16), mesh, [Shard(0)])
    written: dict[int, int] = {}
    requests: dict[int, dict[str, int]] = {}

    def on_event(event) -> None:
        if event.name == "save.written":
            written[event.step] = event.written_nbytes
        if event.name == "save.committed":
            requests[event.step] = event.requests

    async with AsyncCheckpointManager(root, dist_timeout=60, event_handlers=[on_event]) as mgr:
        for step in (1, 2, 3):
            small.to_local().add_(step)
            state = {"frozen": frozen, "shared": shared, "small": small}
            await (await mgr.save(step, state))
        target = {
            "frozen": distribute_tensor(torch.zeros(1024, 512), mesh, [Shard(0)]),
            "shared": distribute_tensor(torch.zeros(512, 512), mesh, [Replicate()]),
            "small": distribute_tensor(torch.zeros(8, 16), mesh, [Shard(0)]),
        }
        await mgr.load(3, into=target)
    return {
        "written": written,
        "requests": requests,
        "equal": {k: torch.equal(target[k].full_tensor(), state[k].full_tensor()) for k in state},
    }


async def rank0_full_save(rank: int, world: int, root: str, args: dict) -> dict:
    """The FSDP + TP model saved two ways in one checkpoint: its full state on rank 0 alone
    (as FSDP1 jobs save with rank0_only), and its sharded state dict on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model, opt = mixed_tp_model([2, 2])
    mixed_step(model, opt)
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"sharded": get_model_state_dict(model)}
    full_sd = get_model_state_dict(model, options=whole)  # a collective: every rank
    if rank == 0:
        state["full"] = full_sd
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        await (await mgr.save(1, state))
    return {"params": {k: full(v) for k, v in model.state_dict().items()}, "saved": sorted(state)}


async def rank0_full_load(rank: int, world: int, root: str, args: dict) -> dict:
    """Both loaded on every rank into a fresh FSDP + TP model of the same mesh."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    out = {}
    async with AsyncCheckpointManager(root, dist_timeout=60) as mgr:
        for key in ("full", "sharded"):
            torch.manual_seed(1)  # other values than the saved ones
            model, _ = mixed_tp_model([2, 2])
            target = {key: get_model_state_dict(model)}
            await mgr.load(1, into=target, keys=[key])
            set_model_state_dict(model, target[key])
            out[key] = {k: full(v) for k, v in model.state_dict().items()}
    return out


SCENARIOS = {
    f.__name__: f
    for f in (
        dedup_saves,
        fsdp_save,
        fsdp_load,
        fsdp_load_lastdim,
        layouts_save,
        layouts_load,
        fixture_v2,
        fsdp_tp_save,
        mixed_tp_save,
        mixed_tp_load_fsdp,
        rank0_full_save,
        rank0_full_load,
        dcp_save,
        dcp_load,
        bad_saves,
        bad_loads,
        outside_group,
    )
}


if __name__ == "__main__":
    serve_rank(SCENARIOS)
