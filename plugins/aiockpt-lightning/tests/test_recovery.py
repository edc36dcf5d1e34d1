"""What a killed run leaves behind, and how the next run puts it right.

A run can be killed at any moment: while a pointer file is being written (its temporary file
stays), between the commit of a ``last.ckpt`` save and the rewrite of ``last.ckpt`` (which
still names an older step), between a pointer's removal and the deletion of its checkpoint (a
committed checkpoint no pointer names), or before the first save to a new name commits (a
pointer to a step that never committed). The tests build that state on disk exactly, from
the files of real runs, then start the next run as a user would, with ``ckpt_path="last"``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import _train
import pytest
import torch
from test_lightning import committed_steps, pointers

from aiockpt_lightning import SAVES_PER_GLOBAL_STEP

pytestmark = [
    pytest.mark.filterwarnings(
        r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
    ),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]

K = SAVES_PER_GLOBAL_STEP


def step_dir(root: Path, step: int) -> Path:
    """The directory of aiockpt step ``step``."""
    return root / f"step_{step:012d}"


def gone_pid() -> int:
    """The id of a process that has ended."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def killed_run(tmp_path: Path) -> tuple[Path, Path]:
    """A root and checkpoint directory as a run killed at global step 16 leaves them."""
    root, ckpts = tmp_path / "root", tmp_path / "ckpts"
    _train.run(str(root), str(ckpts), max_steps=8)
    assert pointers(ckpts)["last.ckpt"] == 8 * K + 1
    old_last = (ckpts / "last.ckpt").read_bytes()
    shutil.copytree(step_dir(root, 8 * K + 1), tmp_path / "aside")

    _train.run(str(root), str(ckpts), max_steps=16, ckpt_path=str(ckpts / "last.ckpt"))
    assert pointers(ckpts)["last.ckpt"] == 16 * K + 1
    assert not step_dir(root, 8 * K + 1).exists()

    # Killed after last.ckpt's save at step 16 committed, before its pointer was rewritten:
    # last.ckpt names the checkpoint of step 8, which is still there.
    shutil.copytree(tmp_path / "aside", step_dir(root, 8 * K + 1))
    (ckpts / "last.ckpt").write_bytes(old_last)
    # ... and in the middle of rewriting it: the temporary file of a process that is gone.
    (ckpts / f"last.ckpt.aiockpt-tmp-{gone_pid()}").write_bytes(old_last[:20])
    # ... after removing a pointer, before deleting its checkpoint.
    (ckpts / "epoch=1-step=12.ckpt").unlink()
    # ... and before the first save to a new name committed: its pointer names a step that
    # is not in the root.
    body = json.loads(old_last)
    body.update(step=20 * K, global_step=20, epoch=2)
    (ckpts / "epoch=2-step=20.ckpt").write_text(json.dumps(body))
    return root, ckpts


def test_the_next_run_cleans_up_and_resumes_from_the_newest_commit(tmp_path: Path) -> None:
    full = _train.run(str(tmp_path / "full-root"), str(tmp_path / "full-ckpts"), max_steps=24)
    root, ckpts = killed_run(tmp_path)

    resumed = _train.run(str(root), str(ckpts), max_steps=24, ckpt_path="last")
    # It resumed from step 16, the newest checkpoint committed for last.ckpt.
    assert resumed["losses"] == {k: v for k, v in full["losses"].items() if int(k) >= 16}
    assert resumed["weights"] == full["weights"]
    assert resumed["optimizer"] == full["optimizer"]

    assert not [p for p in os.listdir(ckpts) if "aiockpt-tmp" in p]
    assert set(pointers(ckpts)) == {
        "epoch=0-step=4.ckpt",
        "epoch=0-step=8.ckpt",
        "epoch=1-step=16.ckpt",
        "epoch=2-step=20.ckpt",  # saved again by the resumed run
        "epoch=2-step=24.ckpt",
        "last.ckpt",
    }
    assert pointers(ckpts)["epoch=2-step=20.ckpt"] == 20 * K
    # The checkpoints no pointer named are gone, those a pointer names all there.
    assert committed_steps(root) == sorted(pointers(ckpts).values())


def test_opening_puts_last_ckpt_right_before_anything_is_loaded(
    tmp_path: Path, plugin: Any
) -> None:
    root, ckpts = killed_run(tmp_path)
    io = plugin(root)
    assert io.load_checkpoint(ckpts / "last.ckpt")["global_step"] == 16
    assert pointers(ckpts)["last.ckpt"] == 16 * K + 1
    assert not [p for p in os.listdir(ckpts) if "aiockpt-tmp" in p]
    assert "epoch=2-step=20.ckpt" not in os.listdir(ckpts)
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(ckpts / "epoch=2-step=20.ckpt")
    assert committed_steps(root) == sorted(pointers(ckpts).values())


def test_a_step_deleted_by_recovery_is_not_reused_by_the_session(
    tmp_path: Path, plugin: Any
) -> None:
    root, ckpts = tmp_path / "root", tmp_path / "ckpts"
    checkpoint = {"global_step": 4, "epoch": 0, "w": torch.ones(2)}
    io = plugin(root)
    io.save_checkpoint(checkpoint, ckpts / "a.ckpt")
    io.teardown()
    (ckpts / "a.ckpt").unlink()  # a removal cut short: a checkpoint no pointer names

    io = plugin(root)
    io.save_checkpoint(checkpoint, ckpts / "b.ckpt")  # opening deletes step 4000 first
    io.teardown()
    assert pointers(ckpts) == {"b.ckpt": 4 * K + 1}
    assert committed_steps(root) == [4 * K + 1]
