"""Pointers are matched to a root by its id, never by how its path or URL is spelled; a
checkpoint is deleted only where the plugin can prove it is an orphan of its own root.

One root opened as a symbolic link, a ``file://`` URL, with a trailing slash or as a relative
path is one root: nothing of it is deleted, and every pointer loads. Pointers written before
they recorded the root's id are matched by the id of the root their path opens. Where a
pointer names another root, or a checkpoint records another root's id, the checkpoint stays
and a warning names the pointer and the roots.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import _train
import pytest
import torch
from test_lightning import committed_steps, pointers

from aiockpt import CheckpointManager
from aiockpt_lightning import SAVES_PER_GLOBAL_STEP
from aiockpt_lightning._codec import encode

pytestmark = [
    pytest.mark.filterwarnings(
        r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
    ),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]

K = SAVES_PER_GLOBAL_STEP


def root_id(root: Path) -> str:
    """The id in the root's ``_root.json``."""
    return str(json.loads((root / "_root.json").read_text())["id"])


def contents(dirpath: Path) -> dict[str, bytes]:
    """Every file of ``dirpath``, by name."""
    return {p.name: p.read_bytes() for p in sorted(dirpath.iterdir())}


def test_every_spelling_of_the_root_deletes_nothing_and_loads(
    tmp_path: Path, plugin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, ckpts = tmp_path / "root", tmp_path / "ckpts"
    _train.run(str(root), str(ckpts), max_steps=8)
    saved = {"epoch=0-step=4.ckpt": 4, "epoch=0-step=8.ckpt": 8, "last.ckpt": 8}
    assert set(pointers(ckpts)) == set(saved)
    steps, files = committed_steps(root), contents(ckpts)
    assert len(steps) == 3

    (tmp_path / "link").symlink_to(tmp_path, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    spellings = [
        str(tmp_path / "link" / "root"),  # through a symbolic link
        f"file://{root}",
        f"file://{root}/",
        f"{root}/",
        "root",  # relative to the working directory
    ]
    for spelling in spellings:
        io = plugin(spelling)
        for name, global_step in saved.items():
            assert io.load_checkpoint(ckpts / name)["global_step"] == global_step, spelling
        io.teardown()
        assert committed_steps(root) == steps, spelling
        assert contents(ckpts) == files, spelling

    # A run resumed through the link saves, replaces and removes as one through the path.
    _train.run(spellings[0], str(ckpts), max_steps=12, ckpt_path=str(ckpts / "last.ckpt"))
    assert pointers(ckpts)["last.ckpt"] == 12 * K + 1
    assert committed_steps(root) == sorted(pointers(ckpts).values())
    assert committed_steps(root) == [4 * K, 8 * K, 12 * K, 12 * K + 1]
    # Each pointer records the root's id, and the spelling it was saved through.
    assert {json.loads(b)["root_id"] for b in contents(ckpts).values()} == {root_id(root)}
    assert json.loads((ckpts / "last.ckpt").read_text())["root"] == spellings[0]


def write_older_pointer(path: Path, root: str, step: int, global_step: int) -> None:
    """A pointer file as the plugin wrote it before pointers recorded the root's id."""
    body = {"aiockpt-lightning": 1, "root": root, "step": step, "global_step": global_step}
    path.write_text(json.dumps({**body, "epoch": 0}, indent=1) + "\n")


def test_older_pointers_are_matched_by_the_root_their_path_opens(
    tmp_path: Path, plugin: Any
) -> None:
    # A root and pointers from before ids: checkpoints whose metadata records no root id,
    # pointers that record none, and no _root.json; one checkpoint's pointer was removed
    # (a removal cut short).
    root, ckpts = tmp_path / "root", tmp_path / "ckpts"
    ckpts.mkdir()
    with CheckpointManager(str(root)) as manager:
        for global_step in (4, 8, 12):
            path = ckpts / f"step={global_step}.ckpt"
            meta = {"file": path.name, "path": str(path), "global_step": global_step, "epoch": 0}
            state = {"global_step": global_step, "epoch": 0, "w": torch.full((2,), global_step)}
            manager.save(global_step * K, encode(state), metadata={"lightning": meta}).result()
            write_older_pointer(path, str(root), global_step * K, global_step)
    (ckpts / "step=12.ckpt").unlink()
    (root / "_root.json").unlink()
    (root / "_peer.key").unlink()
    files = contents(ckpts)

    (tmp_path / "link").symlink_to(tmp_path, target_is_directory=True)
    io = plugin(tmp_path / "link" / "root")
    loaded = io.load_checkpoint(ckpts / "step=8.ckpt")
    assert loaded["global_step"] == 8
    assert torch.equal(loaded["w"], torch.full((2,), 8))
    assert io.load_checkpoint(ckpts / "step=4.ckpt")["global_step"] == 4
    io.teardown()
    # Their root, opened through the path they name, is this one (by its new id): what they
    # name stays, and the checkpoint none names goes.
    assert committed_steps(root) == [4 * K, 8 * K]
    assert contents(ckpts) == files  # read as they are, not rewritten


def test_a_pointer_of_another_root_keeps_the_checkpoint_and_says_so(
    tmp_path: Path, plugin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    root_a, root_b, ckpts = tmp_path / "a", tmp_path / "b", tmp_path / "ckpts"
    a = plugin(root_a)
    a.save_checkpoint({"global_step": 1, "w": torch.ones(2)}, ckpts / "last.ckpt")
    a.save_checkpoint({"global_step": 2, "w": torch.ones(2)}, ckpts / "other.ckpt")
    a.teardown()
    # Another root's run saves over A's last.ckpt: A's checkpoint of it is named no more.
    b = plugin(root_b)
    b.save_checkpoint({"global_step": 3, "w": torch.zeros(2)}, ckpts / "last.ckpt")
    b.teardown()
    assert committed_steps(root_a) == [1 * K, 2 * K]

    a = plugin(root_a)
    with caplog.at_level(logging.WARNING, logger="aiockpt_lightning"):
        assert a.load_checkpoint(ckpts / "other.ckpt")["global_step"] == 2
    assert committed_steps(root_a) == [1 * K, 2 * K]  # kept: it may be needed yet
    said = caplog.text
    assert f"step {1 * K}" in said
    assert str(ckpts / "last.ckpt") in said
    assert f"{root_b} (root id {root_id(root_b)})" in said
    assert f"{root_a} (root id {root_id(root_a)})" in said
    with pytest.raises(ValueError, match=r"use AiockptCheckpointIO\(.*/b'\)"):
        a.load_checkpoint(ckpts / "last.ckpt")
    assert b.load_checkpoint(ckpts / "last.ckpt")["global_step"] == 3


def test_checkpoints_of_another_root_id_are_kept(
    tmp_path: Path, plugin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    root, ckpts = tmp_path / "root", tmp_path / "ckpts"
    io = plugin(root)
    io.save_checkpoint({"global_step": 1}, ckpts / "one.ckpt")
    io.save_checkpoint({"global_step": 2}, ckpts / "two.ckpt")
    io.teardown()
    old = root_id(root)
    # The root's identity is lost (its _root.json removed): it gets a new one at its next
    # writable open, and its checkpoints and pointers record the old one.
    os.unlink(root / "_root.json")

    io = plugin(root)
    with caplog.at_level(logging.WARNING, logger="aiockpt_lightning"):
        io.save_checkpoint({"global_step": 3}, ckpts / "three.ckpt")
        io.wait()
    assert root_id(root) != old
    assert committed_steps(root) == [1 * K, 2 * K, 3 * K]
    assert f"it records the root id {old}" in caplog.text
    with pytest.raises(ValueError, match="_root.json replaced"):
        io.load_checkpoint(ckpts / "one.ckpt")
    assert io.load_checkpoint(ckpts / "three.ckpt")["global_step"] == 3


def test_a_pointer_file_that_cannot_be_read_keeps_what_it_may_name(
    tmp_path: Path, plugin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    root, ckpts = tmp_path / "root", tmp_path / "ckpts"
    io = plugin(root)
    io.save_checkpoint({"global_step": 1}, ckpts / "a.ckpt")
    io.save_checkpoint({"global_step": 2}, ckpts / "b.ckpt")
    io.teardown()
    (ckpts / "a.ckpt").unlink()  # a removal cut short: step 1000 is an orphan
    # ... beside a pointer of a later format, which might name it.
    future = {"aiockpt-lightning": 2, "where": {"root": str(root), "step": 1 * K}}
    (ckpts / "future.ckpt").write_text(json.dumps(future))

    io = plugin(root)
    with caplog.at_level(logging.WARNING, logger="aiockpt_lightning"):
        assert io.load_checkpoint(ckpts / "b.ckpt")["global_step"] == 2
    assert committed_steps(root) == [1 * K, 2 * K]
    assert f"{ckpts / 'future.ckpt'} is a pointer file this version cannot read" in caplog.text
    with pytest.raises(ValueError, match="pointer file of format 2"):
        io.load_checkpoint(ckpts / "future.ckpt")

    # Without it, nothing but this root's own pointers is left: the orphan goes.
    (ckpts / "future.ckpt").unlink()
    assert io.load_checkpoint(ckpts / "b.ckpt")["global_step"] == 2
    assert committed_steps(root) == [2 * K]
