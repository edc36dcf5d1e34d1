"""Checkpoints of every released format version, kept in tests/fixtures, still load.

The fixtures were written by the aiockpt release that introduced each version and are never
rewritten: a change to the format that breaks one of them breaks a promise to every user with
checkpoints on disk.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

from aiockpt import AsyncCheckpointManager

FIXTURES = Path(__file__).parent / "fixtures"
SCRIPT = str(Path(sys.executable).parent / "aiockpt")


@pytest.fixture
def v1_root(tmp_path: Path) -> str:
    root = tmp_path / "v1"
    shutil.copytree(FIXTURES / "format_v1", root)
    return str(root)


def test_format_v1_checkpoint_loads(v1_root: str) -> None:
    events = []

    async def main() -> tuple[list[int], dict]:
        async with AsyncCheckpointManager(v1_root, event_handlers=[events.append]) as mgr:
            return await mgr.steps(), await mgr.load()

    steps, state = anyio.run(main)
    assert steps == [7]
    (end,) = [e for e in events if e.name == "load.end"]
    assert end.read_nbytes == 24 + 24 + 6 + 2  # the four tensors' bytes, nothing else
    model = state["model"]
    assert torch.equal(model["w"], torch.arange(6.0).view(2, 3))
    assert torch.equal(model["b"], torch.ones(3, dtype=torch.float16))
    assert torch.equal(model["i"], torch.tensor([1, -2, 3]))
    assert torch.equal(model["m"], torch.tensor([True, False]))
    assert state["step"] == 7
    assert state["name"] == "v1"
    assert math.isnan(state["lr"])
    assert state["sched"] == (1, [2.5, None])


def test_format_v1_checkpoint_loads_into_a_state(v1_root: str) -> None:
    target = {"model": {"w": torch.zeros(2, 3)}, "step": 0}

    async def main() -> dict:
        async with AsyncCheckpointManager(v1_root) as mgr:
            return await mgr.load(7, into=target)

    out = anyio.run(main)
    assert out is target
    assert torch.equal(target["model"]["w"], torch.arange(6.0).view(2, 3))


def test_format_v1_checkpoint_verifies(v1_root: str) -> None:
    done = subprocess.run([SCRIPT, "verify", v1_root], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
