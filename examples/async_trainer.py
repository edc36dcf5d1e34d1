"""An async trainer that checkpoints with aiockpt while it trains, and resumes where it stopped.

python examples/async_trainer.py --root checkpoints/demo --steps 60 --stop-at 35  # stops early
python examples/async_trainer.py --root checkpoints/demo --steps 60               # resumes
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import anyio
import torch

from aiockpt import AsyncCheckpointManager, EveryNSteps, LatestN


def progress(step: int, steps: int, loss: float, width: int = 24) -> str:
    """A one-line progress bar: where training is and its latest loss."""
    done = width * step // steps
    return f"[{'#' * done}{'.' * (width - done)}] step {step:4d}/{steps}  loss {loss:.4f}"


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
        stalls: list[float] = []
        commits: list[float] = []
        live = sys.stdout.isatty()  # redraw one bar on a terminal; plain lines in a log
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
                stalls.append(stall)
                pending.append((handle, t0, stall))
            if live:
                print("\r" + progress(step, steps, loss.item()), end="", flush=True)
            for handle, t0, stall in [p for p in pending if p[0].done()]:
                info = await handle
                commit = time.perf_counter() - t0
                commits.append(commit)
                print(
                    ("\r" if live else "")
                    + f"{progress(info.step, steps, info.metrics['loss'])}  saved: "
                    f"stall {stall * 1e3:6.2f} ms, committed after {commit * 1e3:6.1f} ms"
                )
                pending.remove((handle, t0, stall))
            await anyio.sleep(0.005)  # a real trainer awaits its next batch here; saves go on
            if stop_at is not None and step >= stop_at:
                print(f"stopping at step {step} (as if preempted)")
                break
        if live:
            print()
        await mgr.wait()
        for handle, t0, stall in pending:
            info = await handle
            print(
                f"{progress(info.step, steps, info.metrics['loss'])}  saved: "
                f"stall {stall * 1e3:6.2f} ms, committed within "
                f"{(time.perf_counter() - t0) * 1e3:6.1f} ms (awaited at the end)"
            )
        if stalls:
            print(
                f"{len(stalls)} saves: median stall {statistics.median(stalls) * 1e3:.2f} ms, "
                f"median time to commit {statistics.median(commits or [0.0]) * 1e3:.1f} ms "
                "(training went on meanwhile)"
            )
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
