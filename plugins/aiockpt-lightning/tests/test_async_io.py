"""The plugin wrapped in Lightning's AsyncCheckpointIO, which saves from a thread of its own
while removals come from the training thread.

Ported from Lightning's plugins/test_checkpoint_io_plugin.py (``test_async_checkpoint_plugin``):
a ``validate`` then a ``fit`` of three one-batch epochs, top 2 by step.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import _train
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from test_lightning import committed_steps, pointers

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
