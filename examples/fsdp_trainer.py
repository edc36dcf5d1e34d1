"""An FSDP2 trainer that checkpoints its sharded state with aiockpt, and resumes on any world size.

    torchrun --nproc-per-node 2 examples/fsdp_trainer.py --root checkpoints/fsdp --stop-after 7
    torchrun --nproc-per-node 4 examples/fsdp_trainer.py --root checkpoints/fsdp  # resumes

The model is sharded with ``fully_shard``: its parameters and AdamW's moments are DTensors,
each rank holding a piece (the output layer's 5 rows split 3 + 2 on 2 ranks, 2 + 2 + 1 + 0 on
4). A save writes each piece once; a load reshards onto the mesh of the run that loads, so
the first run can stop on 2 ranks and the second resume on 4.

Every rank trains on the same whole batch, drawn from the step number, so FSDP's averaged
gradients equal one process's and the run is the same on any world size: the resumed run
ends with the loss an uninterrupted run ends with.
"""

from __future__ import annotations

import argparse
import os
import sys

import anyio
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from aiockpt import AsyncCheckpointManager, LatestN, SaveHandle

IN, HIDDEN, OUT = 8, 32, 5  # OUT rows do not divide evenly over 2 or 4 ranks


def make_model(world: int) -> torch.nn.Module:
    """The model, sharded over every rank: each layer, then the root, as FSDP2 recommends."""
    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: the same on every rank and in every run, so a resumed run sees
    the data it would have seen, with no data-loader state to save."""
    teacher = torch.Generator().manual_seed(7)
    true_w = torch.randn(IN, OUT, generator=teacher)
    x = torch.randn(16, IN, generator=torch.Generator().manual_seed(1000 + step))
    return x, torch.tanh(x @ true_w)


async def train(root: str, steps: int, stop_after: int | None, save_every: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    state = {"model": model, "optim": opt, "step": 0}
    rows = model[2].weight.to_local().shape[0]  # this rank's piece of a DTensor
    say(f"[rank {rank}/{world}] holds {rows} of the output layer's {OUT} rows")

    async with AsyncCheckpointManager(root, retention=LatestN(2)) as mgr:
        start = 0
        if await mgr.latest_step() is not None:
            # Resharded onto this run's mesh; the optimizer's DTensor moments are created
            # first (it has no state yet), then restored.
            await mgr.load(into=state)
            start = state["step"]
            say(f"[rank {rank}/{world}] RESUMED from step {start}")
        pending: SaveHandle | None = None
        step, loss = start, float("nan")
        for step in range(start + 1, steps + 1):
            x, y = batch(step)
            out = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            out.backward()
            opt.step()
            loss = out.item()
            if rank == 0:
                say(f"step {step:4d}  loss {loss:.6f}")
            if step % save_every == 0:
                await committed(pending, rank)  # at most one save in flight
                state["step"] = step
                # Returns once the state is copied out: training goes on while it is written.
                pending = await mgr.save(step, state, metrics={"loss": loss})
            if stop_after is not None and step >= stop_after:
                say(f"[rank {rank}/{world}] stopping after step {step} (as if preempted)")
                break
        await committed(pending, rank)
        if rank == 0:
            say(f"committed steps: {await mgr.steps()}")
            say(f"done step={step} loss={loss!r}")


def say(line: str) -> None:
    """Print one line in one write: the ranks share torchrun's stdout, and print() writes
    the text and its newline apart, so another rank's line could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def committed(handle: SaveHandle | None, rank: int) -> None:
    """Wait for a save handed to the daemon earlier to commit on every rank."""
    if handle is None:
        return
    info = await handle
    if rank == 0:
        say(f"saved step {info.step} to {info.url}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", default="checkpoints/fsdp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument(
        "--stop-after", type=int, default=None, help="stop after this step, as if preempted"
    )
    p.add_argument("--save-every", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    try:
        anyio.run(train, args.root, args.steps, args.stop_after, args.save_every)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
