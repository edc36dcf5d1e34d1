"""An async trainer that checkpoints with aiockpt while it trains, and resumes where it stopped.

python examples/async_trainer.py --root checkpoints/demo --steps 60 --stop-at 35  # stops early
python examples/async_trainer.py --root checkpoints/demo --steps 60               # resumes
"""

from __future__ import annotations

import argparse
import time

import anyio
import torch

from aiockpt import AsyncCheckpointManager, EveryNSteps, LatestN


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


async def train(root: str, steps: int, stop_at: int | None, save_every: int) -> None:
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    true_w = torch.randn(32, 1)
    state = {"model": model, "optim": opt, "step": 0, "rng": torch.get_rng_state()}

    async with AsyncCheckpointManager(root, retention=LatestN(2) | EveryNSteps(50)) as mgr:
        start = 0
        if (latest := await mgr.latest_step()) is not None:
            await mgr.load(latest, into=state)
            torch.set_rng_state(state["rng"])
            start = state["step"]
            print(f"RESUMED from step {start} (checkpoint {latest} in {root})")
        else:
            print(f"starting fresh in {root}")
        pending = []
        for step in range(start + 1, steps + 1):
            x = torch.randn(64, 32)
            y = x @ true_w + 0.01 * torch.randn(64, 1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % save_every == 0:
                state["step"], state["rng"] = step, torch.get_rng_state()
                t0 = time.perf_counter()
                handle = await mgr.save(step, state, metrics={"loss": loss.item()})
                stall = time.perf_counter() - t0
                pending.append((handle, t0, stall))
            for handle, t0, stall in [p for p in pending if p[0].done()]:
                info = await handle
                commit_ms = (time.perf_counter() - t0) * 1e3
                print(
                    f"step {info.step:4d}  loss {info.metrics['loss']:.4f}  "
                    f"stall {stall * 1e3:6.2f} ms  committed after {commit_ms:7.1f} ms"
                )
                pending.remove((handle, t0, stall))
            await anyio.sleep(0)  # a real trainer awaits data here; saves progress meanwhile
            if stop_at is not None and step >= stop_at:
                print(f"stopping at step {step} (as if preempted)")
                break
        await mgr.wait()
        for handle, _, stall in pending:
            info = await handle
            print(f"step {info.step:4d}  stall {stall * 1e3:6.2f} ms  committed")
        print(f"committed checkpoints: {await mgr.steps()}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", default="checkpoints/demo")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--save-every", type=int, default=5)
    args = p.parse_args()
    anyio.run(train, args.root, args.steps, args.stop_at, args.save_every)


if __name__ == "__main__":
    main()
