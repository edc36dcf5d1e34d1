"""skip_unchanged=True: a tensor whose storage and version counter are what they were at the
last save is not copied again, and the daemon takes its checksums (and, with deduplication, its
blocks' hashes) from that save instead of reading it; every checkpoint still loads exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiockpt import AsyncCheckpointManager, LatestN

SCRIPT = str(Path(sys.executable).parent / "aiockpt")


def verify(root: str) -> None:
    done = subprocess.run([SCRIPT, "verify", root], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def lora() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.base = torch.nn.ModuleList(torch.nn.Linear(256, 256, bias=False) for _ in range(6))
    model.adapter = torch.nn.Parameter(torch.zeros(8, 256))
    for p in model.base.parameters():
        p.requires_grad_(False)
    return model, torch.optim.AdamW([model.adapter], lr=1e-2)


def step_once(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    h = torch.randn(4, 256)
    for layer in model.base:
        h = layer(h) + h @ model.adapter.T @ model.adapter
    opt.zero_grad()
    h.square().mean().backward()
    opt.step()


@pytest.mark.parametrize("dedup", [True, False])
def test_a_lora_run_copies_the_adapters_only_and_loads_exactly(tmp_path, dedup) -> None:
    root = str(tmp_path / "run")
    model, opt = lora()
    staged, saved = {}, {}

    def on_event(event) -> None:
        if event.name == "save.staged":
            staged[event.step] = (event.nbytes, event.copied_nbytes)

    async def main() -> list[int]:
        async with AsyncCheckpointManager(
            root, dedup=dedup, skip_unchanged=True, retention=LatestN(3), event_handlers=[on_event]
        ) as mgr:
            for step in range(1, 7):
                step_once(model, opt)
                await (await mgr.save(step, {"model": model, "optim": opt}))
                saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
            for step in await mgr.steps():
                got = await mgr.load(step)
                for k, v in saved[step].items():
                    assert torch.equal(got["model"][k], v), (step, k)
            return await mgr.steps()

    assert anyio.run(main) == [4, 5, 6]
    base = 6 * 256 * 256 * 4
    assert staged[1][1] == staged[1][0]  # the first save copies everything
    for step in range(2, 7):
        nbytes, copied = staged[step]
        assert copied <= nbytes - base  # the frozen base stayed in the slab
        assert copied >= 3 * 8 * 256 * 4  # the adapter and its two moments
    verify(root)


def test_the_ways_a_tensor_changes_are_seen(tmp_path) -> None:
    """In-place ops (also under no_grad), a new tensor in the state, a parameter given a new
    tensor through .data, a resize: all saved. A change written through ``.data`` in place
    bumps no version counter: it is the one change skip_unchanged does not see (documented),
    and the default saves it."""
    root, plain = str(tmp_path / "run"), str(tmp_path / "plain")
    p = torch.nn.Parameter(torch.zeros(1000))
    state = {"a": torch.zeros(1000), "b": torch.zeros(1000), "p": p, "c": torch.zeros(10)}

    async def main() -> None:
        async with (
            AsyncCheckpointManager(root, skip_unchanged=True) as mgr,
            AsyncCheckpointManager(plain) as ref,
        ):

            async def save(step: int) -> dict:
                await (await mgr.save(step, state))
                await (await ref.save(step, state))
                return {k: v.detach().clone() for k, v in state.items()}

            await save(1)
            state["a"][3] = 1.0
            with torch.no_grad():
                p.add_(2.0)
            state["b"] = torch.ones(1000)
            want = await save(2)
            p.data = torch.full((1000,), 5.0)
            state["c"].resize_(12).fill_(7.0)
            want3 = await save(3)
            p.data.add_(1.0)  # no version bump
            want4 = await save(4)
            for step, expect in ((2, want), (3, want3)):
                got = await mgr.load(step)
                for k, v in expect.items():
                    assert torch.equal(got[k], v), (step, k)
            got = await mgr.load(4)
            assert torch.equal(got["p"], want3["p"])  # not seen: the value of step 3
            assert torch.equal((await ref.load(4))["p"], want4["p"])  # the default saw it

    anyio.run(main)
    verify(root)


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    sizes=st.lists(st.sampled_from([3, 700, 40_000, 300_000, 5_000_000]), min_size=2, max_size=6),
    changes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=2, max_size=5),
)
def test_random_in_place_changes_with_skip_unchanged_load_back(tmp_path_factory, sizes, changes):
    root = str(tmp_path_factory.mktemp("skip") / "run")
    torch.manual_seed(len(sizes))
    state = {f"t{i}": torch.randn(n) for i, n in enumerate(sizes)}
    saved = {}

    async def main() -> None:
        async with AsyncCheckpointManager(root, skip_unchanged=True) as mgr:
            for step, changed in enumerate(changes, start=1):
                for i in changed:
                    t = state[f"t{i % len(sizes)}"]
                    t[torch.randint(0, t.numel(), (1,))] += 1.0
                await (await mgr.save(step, state))
                saved[step] = {k: v.clone() for k, v in state.items()}
            for step in await mgr.steps():
                got = await mgr.load(step)
                for k, v in saved[step].items():
                    assert torch.equal(got[k], v), (step, k)

    anyio.run(main)
    verify(root)


def test_skip_unchanged_is_checked() -> None:
    with pytest.raises(TypeError, match="skip_unchanged"):
        AsyncCheckpointManager("/tmp/unused", skip_unchanged="yes")  # type: ignore[arg-type]
