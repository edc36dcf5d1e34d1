"""The plugin under Lightning's multi-process strategies on the CPU (gloo): ``ddp_spawn`` and
``ddp``, each with two real processes.

Lightning saves and removes checkpoints on global rank 0 only, while the other ranks go on to
its next barrier; every rank loads. (Each run pays for starting its processes, which import
torch and Lightning: most of these tests' time.) In the spirit of Lightning's own
``test_model_torch_save_ddp_cpu`` (checkpointing/test_torch_saving.py), each run is a whole fit
in a fresh process, bounded by a timeout so that a deadlock fails the test.

Every rank trains on the same batches, so the gradients DDP averages are equal and a
two-process run computes, bit for bit, what one process does: the runs here are checked
against one uninterrupted single-process run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import _train
import pytest
from test_lightning import HERE, committed_steps, pointers

from aiockpt_lightning import SAVES_PER_GLOBAL_STEP

pytestmark = [
    pytest.mark.filterwarnings(
        r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
    ),
]

#: A deadlocked run is stopped after this many seconds (a run takes a few).
DEADLOCK = 90


def train(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    """Run ``_train.py ARGS OUT`` in a fresh process; the record rank 0 wrote."""
    out = tmp_path / f"{name}.json"
    root, dirpath, max_steps, ckpt, *rest = args
    # A session of its own: a deadlocked run is stopped whole, its ranks and daemons too.
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_train.py"), root, dirpath, max_steps, ckpt, str(out), *rest],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=DEADLOCK)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the run did not end within {DEADLOCK} s: {stderr[-4000:]}")
    assert proc.returncode == 0, stderr[-4000:]
    return dict(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The record of one uninterrupted single-process run of 24 steps."""
    tmp = tmp_path_factory.mktemp("full")
    return _train.run(str(tmp / "root"), str(tmp / "ckpts"), max_steps=24)


def same_as(full: dict[str, Any], run: dict[str, Any], start: int) -> None:
    """``run``, which started at step ``start``, computed what the uninterrupted run did."""
    assert run["losses"] == {k: v for k, v in full["losses"].items() if int(k) >= start}
    for key in ("weights", "optimizer", "lr", "global_step"):
        assert run[key] == full[key], key


# The resume saves into a new directory, on purpose (Lightning warns its top-k state stays).
@pytest.mark.filterwarnings("ignore:The dirpath has changed from:UserWarning")
def test_ddp_spawn_saves_and_one_process_resumes(tmp_path: Path, full: dict[str, Any]) -> None:
    root, ckpts = tmp_path / "root", tmp_path / "ckpts"
    first = train(tmp_path, "first", str(root), str(ckpts), "16", "-", "ddp_spawn", "2")
    assert first["losses"] == {k: v for k, v in full["losses"].items() if int(k) < 16}
    assert pointers(ckpts) == {
        "epoch=0-step=4.ckpt": 4 * SAVES_PER_GLOBAL_STEP,
        "epoch=0-step=8.ckpt": 8 * SAVES_PER_GLOBAL_STEP,
        "epoch=1-step=12.ckpt": 12 * SAVES_PER_GLOBAL_STEP,
        "epoch=1-step=16.ckpt": 16 * SAVES_PER_GLOBAL_STEP,
        "last.ckpt": 16 * SAVES_PER_GLOBAL_STEP + 1,
    }
    # Only what the pointers name: the weights ddp_spawn hands back to its launching process
    # through the plugin were removed once read.
    assert committed_steps(root) == sorted(pointers(ckpts).values())

    # What two processes saved, one process resumes from: a checkpoint does not depend on the
    # number of processes that saved it.
    alone = _train.run(str(root), str(tmp_path / "alone"), 24, str(ckpts / "epoch=0-step=8.ckpt"))
    same_as(full, alone, 8)


def test_ddp_saves_and_resumes_on_every_rank(tmp_path: Path, full: dict[str, Any]) -> None:
    root, ckpts = tmp_path / "root", tmp_path / "ckpts"
    # Lightning starts rank 1 by running the same script again.
    first = train(tmp_path, "first", str(root), str(ckpts), "16", "-", "ddp", "2")
    assert first["losses"] == {k: v for k, v in full["losses"].items() if int(k) < 16}
    assert set(pointers(ckpts)) == {
        "epoch=0-step=4.ckpt",
        "epoch=0-step=8.ckpt",
        "epoch=1-step=12.ckpt",
        "epoch=1-step=16.ckpt",
        "last.ckpt",
    }
    assert committed_steps(root) == sorted(pointers(ckpts).values())

    # Both ranks load last.ckpt (rank 1 reading while rank 0 holds the root) and go on.
    again = train(tmp_path, "again", str(root), str(ckpts), "24", "last", "ddp", "2")
    same_as(full, again, 16)
    assert pointers(ckpts)["last.ckpt"] == 24 * SAVES_PER_GLOBAL_STEP + 1
    assert committed_steps(root) == sorted(pointers(ckpts).values())
