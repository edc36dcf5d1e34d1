"""The plugin wrapped in Lightning's AsyncCheckpointIO, which saves from a thread of its own
while removals come from the training thread; and loads by a second plugin instance while the
first still holds the root.

Ported from Lightning's plugins/test_checkpoint_io_plugin.py (``test_async_checkpoint_plugin``):
a ``validate`` then a ``fit`` of three one-batch epochs, top 2 by step; after it, a new
plugin on the same root loads the checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import _train
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from test_lightning import committed_steps, pointers

from aiockpt import RootLockedError

pytestmark = [
    pytest.mark.filterwarnings(
        r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
    ),
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no"),
]


class Validated(_train.Tiny):
    """Tiny with a validation step."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """The batch's mean squared error, logged as ``val_loss``."""
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), batch_size=len(x))


def test_under_async_checkpoint_io(tmp_path: Path, plugin: Any) -> None:
    root, dirpath = tmp_path / "root", tmp_path / "ckpts"
    io = plugin(root)
    wrapped = AsyncCheckpointIO(io)
    mc = ModelCheckpoint(dirpath=dirpath, save_top_k=2, monitor="step", mode="max")
    trainer = _train.trainer(
        wrapped, -1, [mc], max_epochs=3, limit_train_batches=1, limit_val_batches=0
    )
    model = Validated()
    trainer.validate(model, dataloaders=_train.Batches())
    trainer.fit(model, train_dataloaders=_train.Batches())
    # AsyncCheckpointIO's teardown joins its thread and does not tear the plugin down.
    io.wait()
    assert set(os.listdir(dirpath)) == {"epoch=1-step=2.ckpt", "epoch=2-step=3.ckpt"}
    assert committed_steps(root) == sorted(pointers(dirpath).values())
    assert io.load_checkpoint(dirpath / "epoch=2-step=3.ckpt")["global_step"] == 3

    # The plugin still holds the root (AsyncCheckpointIO did not tear it down): a new plugin
    # on the same root loads beside it, and the first goes on saving.
    second = plugin(root)
    loaded = second.load_checkpoint(dirpath / "epoch=2-step=3.ckpt")
    assert loaded["global_step"] == 3
    assert torch.equal(loaded["state_dict"]["net.weight"], model.net.weight.detach())
    assert second.load_checkpoint(dirpath / "epoch=1-step=2.ckpt")["global_step"] == 2
    io.save_checkpoint({"global_step": 4, "epoch": 3}, dirpath / "more.ckpt")
    io.wait()
    assert second.load_checkpoint(dirpath / "more.ckpt")["global_step"] == 4


def test_first_use_from_several_threads_opens_one_manager(tmp_path: Path, plugin: Any) -> None:
    io = plugin(tmp_path / "root")
    dirpath = tmp_path / "ckpts"
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def save(i: int) -> None:
        start.wait()
        try:
            if i % 2:
                io.remove_checkpoint(dirpath / f"gone-{i}.ckpt")
            else:
                checkpoint = {"global_step": i, "w": torch.full((3,), float(i))}
                io.save_checkpoint(checkpoint, dirpath / f"{i}.ckpt")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    io.wait()
    assert set(pointers(dirpath)) == {"0.ckpt", "2.ckpt"}
    assert torch.equal(io.load_checkpoint(dirpath / "2.ckpt")["w"], torch.full((3,), 2.0))


HOLD = """
import sys, torch
from aiockpt_lightning import AiockptCheckpointIO

io = AiockptCheckpointIO(sys.argv[1])
io.save_checkpoint({"global_step": 7, "w": torch.arange(3.0)}, sys.argv[2])
io.wait()
print("saved", flush=True)
sys.stdin.read()  # holds the root until the test is done with it
io.save_checkpoint({"global_step": 8, "w": torch.arange(3.0)}, sys.argv[2])
io.teardown()
print("saved again", flush=True)
"""


def test_a_load_reads_beside_a_writer_of_another_process(tmp_path: Path, plugin: Any) -> None:
    root, ckpt = tmp_path / "root", tmp_path / "ckpts" / "last.ckpt"
    writer = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(root), str(ckpt)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline() == "saved\n"
        reader = plugin(root)
        loaded = reader.load_checkpoint(ckpt)
        assert loaded["global_step"] == 7
        assert torch.equal(loaded["w"], torch.arange(3.0))
        with pytest.raises(RootLockedError):  # a removal needs the lease
            reader.remove_checkpoint(ckpt)
        out, err = writer.communicate("", timeout=120)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.communicate()
    assert writer.returncode == 0, err[-3000:]
    assert out == "saved again\n"
    assert reader.load_checkpoint(ckpt)["global_step"] == 8
    assert committed_steps(root) == [8 * 1000]
