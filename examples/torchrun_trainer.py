"""A data-parallel trainer that checkpoints every rank with aiockpt, and resumes.

    torchrun --nproc-per-node 2 examples/torchrun_trainer.py --root checkpoints/ddp --steps 40
    torchrun --nproc-per-node 2 examples/torchrun_trainer.py --root checkpoints/ddp --steps 80

Each rank saves its own state (the replicated model and optimizer, and its own data-loader
position and RNG); the checkpoint commits once every rank's shard has landed. The second run
resumes every rank from the latest committed step.
"""

from __future__ import annotations

import argparse
import os

import anyio
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from aiockpt import AsyncCheckpointManager, LatestN


async def train(root: str, steps: int, save_every: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank draws its own data
    true_w = torch.arange(16, dtype=torch.float32).unsqueeze(1) / 16
    state = {"model": model.module, "optim": opt, "step": 0, "data_rng": gen.get_state()}

    async with AsyncCheckpointManager(root, retention=LatestN(2)) as mgr:
        start = 0
        if await mgr.latest_step() is not None:
            await mgr.load(into=state)
            gen.set_state(state["data_rng"])
            start = state["step"]
            print(f"[rank {rank}/{world}] RESUMED from step {start}", flush=True)
        for step in range(start + 1, steps + 1):
            x = torch.randn(32, 16, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), x @ true_w)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % save_every == 0:
                state.update(step=step, data_rng=gen.get_state())
                handle = await mgr.save(step, state, metrics={"loss": loss.item()})
                info = await handle
                if rank == 0:
                    print(
                        f"step {step:4d}  loss {loss.item():.5f}  committed {info.url}", flush=True
                    )
        print(f"[rank {rank}] committed steps: {await mgr.steps()}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", default="checkpoints/ddp")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    args = p.parse_args()
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    try:
        anyio.run(train, args.root, args.steps, args.save_every)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
