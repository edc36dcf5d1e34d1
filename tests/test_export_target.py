"""``aiockpt export`` never writes into a checkpoint root: not into the one it exports (its OUT
would replace a manifest or a shard, or sit where writers read the lease), nor into another."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from aiockpt import CheckpointManager
from aiockpt.cli import main as cli_main


def make_root(path: Path) -> str:
    root = str(path)
    with CheckpointManager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((64,), float(step))}).result()
    return root


def snapshot(root: str) -> dict[str, str]:
    """Every file of ``root`` by its path, with its bytes' hash."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in Path(root).rglob("*")
        if p.is_file()
    }


@pytest.mark.parametrize(
    ("inside", "extra"),
    [
        ("step_000000000002/manifest.json", []),
        ("step_000000000002/shard_r00000.safetensors", []),
        ("_lease/g000000000002.json", []),
        ("exported.safetensors", []),
        ("exported", ["--max-shard-size", "1MB"]),
    ],
    ids=["a manifest", "a shard", "the lease", "a new file", "a new directory"],
)
def test_an_out_inside_the_exported_root_is_refused(tmp_path, capsys, inside, extra):
    root = make_root(tmp_path / "run")
    before = snapshot(root)
    out = os.path.join(root, inside)
    assert cli_main(["export", root, out, "--step", "2", *extra]) == 2
    err = capsys.readouterr().err
    assert "inside the checkpoint root" in err
    assert len(err.splitlines()) == 1
    assert snapshot(root) == before  # nothing written, nothing replaced
    with CheckpointManager(root) as mgr:  # and the next writer gets the root
        assert mgr.steps() == [1, 2]
        assert torch.equal(mgr.load(2)["w"], torch.full((64,), 2.0))


def test_an_out_inside_another_root_or_through_a_link_is_refused(tmp_path, capsys):
    root = make_root(tmp_path / "run")
    other = make_root(tmp_path / "other")
    os.makedirs(os.path.join(other, "exports"))
    before = snapshot(other)
    out = os.path.join(other, "exports", "model.safetensors")
    assert cli_main(["export", root, out, "--step", "2"]) == 2
    assert f"inside the checkpoint root {other}" in capsys.readouterr().err
    assert snapshot(other) == before
    os.symlink(root, tmp_path / "link")
    out = str(tmp_path / "link" / "step_000000000001" / "manifest.json")
    assert cli_main(["export", root, out, "--step", "2"]) == 2
    assert "inside the checkpoint root" in capsys.readouterr().err
    with CheckpointManager(root, read_only=True) as mgr:
        assert torch.equal(mgr.load(1)["w"], torch.full((64,), 1.0))


def test_an_out_beside_the_root_is_written(tmp_path):
    root = make_root(tmp_path / "run")
    out = tmp_path / "model.safetensors"
    assert cli_main(["export", root, str(out), "--step", "2"]) == 0
    assert out.stat().st_size > 64 * 4
