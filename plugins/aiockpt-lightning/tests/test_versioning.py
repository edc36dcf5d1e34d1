"""ModelCheckpoint's file-name versioning through the plugin.

ModelCheckpoint asks the filesystem whether a name is taken and, if it is, adds ``-vN``. Ported
from Lightning's checkpointing/test_model_checkpoint.py (``test_ckpt_version_after_rerun_*``,
``test_save_last_versioning``) and plugins/test_checkpoint_io_plugin.py
(``test_checkpoint_plugin_called``, its second Trainer): a name is taken from the moment its
save starts, so no version is ever given twice and no checkpoint overwritten.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import _train
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from test_lightning import committed_steps, pointers

pytestmark = [
    pytest.mark.filterwarnings(
        r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
    ),
    # Each Trainer after the first saves into a directory that holds checkpoints already.
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]


def fit_epochs(io: Any, callback: ModelCheckpoint, epochs: int, **kwargs: Any) -> Any:
    """A Trainer of ``epochs`` one-batch epochs, fitted once."""
    trainer = _train.trainer(io, -1, [callback], max_epochs=epochs, limit_train_batches=1, **kwargs)
    trainer.fit(_train.Tiny(), train_dataloaders=_train.Batches())
    return trainer


def assert_all_distinct_and_loadable(io: Any, dirpath: Path, root: Path) -> None:
    """Each pointer names a checkpoint of its own, committed and loadable; nothing else is
    in the root."""
    named = pointers(dirpath)
    assert len(set(named.values())) == len(named)
    assert committed_steps(root) == sorted(named.values())
    for name in named:
        assert "state_dict" in io.load_checkpoint(dirpath / name)


def test_rerun_of_the_same_trainer_versions_every_name(tmp_path: Path, plugin: Any) -> None:
    root, dirpath = tmp_path / "root", tmp_path / "ckpts"
    io = plugin(root)
    mc = ModelCheckpoint(dirpath=dirpath, save_top_k=-1, monitor="epoch", filename="test")
    mc.STARTING_VERSION = 9
    trainer = fit_epochs(io, mc, 2)
    trainer.fit_loop.max_epochs = 4
    trainer.fit(_train.Tiny(), train_dataloaders=_train.Batches())

    expected = {"test.ckpt", "test-v9.ckpt", "test-v10.ckpt", "test-v11.ckpt"}
    assert {Path(f).name for f in mc.best_k_models} == expected
    assert set(os.listdir(dirpath)) == expected
    assert_all_distinct_and_loadable(io, dirpath, root)
    # Each name holds the epoch it was saved at.
    epochs = {name: io.load_checkpoint(dirpath / name)["epoch"] for name in expected}
    assert sorted(epochs.values()) == [0, 1, 2, 3]


def test_a_new_trainer_versions_the_names_of_the_last(tmp_path: Path, plugin: Any) -> None:
    root, dirpath = tmp_path / "root", tmp_path / "ckpts"
    io = plugin(root)
    for i in range(2):
        mc = ModelCheckpoint(dirpath=dirpath, save_top_k=-1, monitor="epoch", filename="{epoch}")
        fit_epochs(io, mc, 2)
        expected = {"epoch=0-v1.ckpt", "epoch=1-v1.ckpt"} if i else {"epoch=0.ckpt", "epoch=1.ckpt"}
        assert {Path(f).name for f in mc.best_k_models} == expected
    assert set(os.listdir(dirpath)) == {
        "epoch=0.ckpt",
        "epoch=1.ckpt",
        "epoch=0-v1.ckpt",
        "epoch=1-v1.ckpt",
    }
    assert_all_distinct_and_loadable(io, dirpath, root)


def test_save_last_with_top_k_is_versioned_too(tmp_path: Path, plugin: Any) -> None:
    root, dirpath = tmp_path / "root", tmp_path / "ckpts"
    io = plugin(root)
    for _ in range(2):
        mc = ModelCheckpoint(dirpath=dirpath, save_last=True)
        fit_epochs(io, mc, 2)
    assert set(os.listdir(dirpath)) == {
        "epoch=1-step=2.ckpt",
        "last.ckpt",
        "epoch=1-step=2-v1.ckpt",
        "last-v1.ckpt",
    }
    assert Path(mc.best_model_path).name == "epoch=1-step=2-v1.ckpt"
    assert Path(mc.last_model_path).name == "last-v1.ckpt"
    assert_all_distinct_and_loadable(io, dirpath, root)
    assert io.load_checkpoint(dirpath / "last-v1.ckpt")["global_step"] == 2


def test_save_last_alone_is_versioned(tmp_path: Path, plugin: Any) -> None:
    root, dirpath = tmp_path / "root", tmp_path / "ckpts"
    io = plugin(root)
    for _ in range(2):
        fit_epochs(io, ModelCheckpoint(dirpath=dirpath, save_top_k=0, save_last=True), 2)
    assert set(os.listdir(dirpath)) == {"last.ckpt", "last-v1.ckpt"}
    assert not any(os.path.islink(dirpath / name) for name in os.listdir(dirpath))
    assert_all_distinct_and_loadable(io, dirpath, root)
