"""examples/fsdp_trainer.py under torchrun: saved on 2 ranks, resumed on 4, as if never stopped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fsdp_trainer.py"
STEPS, STOP_AFTER = 8, 5  # saves every 3 steps: the stopped run's last save is step 3


def torchrun(ranks: int, root: Path, *args: str) -> str:
    """Run the example on ``ranks`` gloo ranks; its stdout (every rank's, interleaved)."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(ranks), str(EXAMPLE), "--root", str(root), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def losses(out: str) -> dict[int, str]:
    """Rank 0's printed loss of each step this run trained."""
    return {int(s): loss for s, loss in re.findall(r"^step +(\d+) +loss (\S+)$", out, re.M)}


def final(out: str) -> tuple[int, str]:
    """The step and the loss (as printed, in full) of the run's last line."""
    m = re.search(r"^done step=(\d+) loss=(\S+)$", out, re.M)
    assert m is not None, out
    return int(m[1]), m[2]


def saved(out: str) -> list[int]:
    return [int(s) for s in re.findall(r"^saved step (\d+) ", out, re.M)]


def rows(manifest: Path, name: str) -> list[int]:
    """How many rows of DTensor ``name`` each written chunk holds, in the manifest's order."""
    entry = json.loads(manifest.read_text())["dtensors"][name]
    return [c["sizes"][0] for c in entry["chunks"]]


@pytest.mark.slow
@pytest.mark.timeout(360)  # three torchruns of at most 120 s each
def test_saved_on_two_ranks_resumes_on_four_as_if_never_stopped(tmp_path):
    root = tmp_path / "fsdp"
    stopped = torchrun(2, root, "--steps", str(STEPS), "--stop-after", str(STOP_AFTER))
    assert "RESUMED" not in stopped
    assert final(stopped)[0] == STOP_AFTER
    assert saved(stopped) == [3]
    # The output layer's 5 rows, 3 + 2 over 2 ranks: each chunk written once, by its holder.
    step_dir = root / "step_000000000003"
    assert rows(step_dir / "manifest.json", "model/2.weight") == [3, 2]
    assert rows(step_dir / "manifest.json", "optim/state/3/exp_avg") == [3, 2]

    resumed = torchrun(4, root, "--steps", str(STEPS))
    for rank in range(4):
        assert f"[rank {rank}/4] RESUMED from step 3" in resumed
    assert saved(resumed) == [6]
    # On 4 ranks the rows split 2 + 2 + 1 + 0: the empty piece writes nothing.
    assert rows(root / "step_000000000006" / "manifest.json", "model/2.weight") == [2, 2, 1]

    whole = torchrun(1, tmp_path / "whole", "--steps", str(STEPS))
    assert "RESUMED" not in whole
    step, loss = final(whole)
    assert step == STEPS
    assert final(resumed) == (STEPS, loss)  # the same float, printed in full
    every = losses(whole)
    assert losses(stopped) == {s: every[s] for s in range(1, STOP_AFTER + 1)}
    assert losses(resumed) == {s: every[s] for s in range(4, STEPS + 1)}
