"""A root's identity: made once at its first writable open, the same however the root is
spelled, different for every root, and added to an older root at its next writable open."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import anyio
import pytest
import torch

from aiockpt import AsyncCheckpointManager, CheckpointManager
from aiockpt.errors import CorruptCheckpointError

FIXTURES = Path(__file__).parent / "fixtures"


def open_id(root: str, **kw: object) -> str | None:
    with CheckpointManager(root, **kw) as mgr:  # type: ignore[arg-type]
        return mgr.root_id


def test_a_root_gets_an_id_and_a_private_peer_key_at_its_first_writable_open(tmp_path):
    root = tmp_path / "run"
    rid = open_id(str(root))
    assert rid is not None
    assert len(rid) == 32
    assert int(rid, 16) >= 0
    doc = json.loads((root / "_root.json").read_text())
    assert doc == {"format": "aiockpt-root", "id": rid}
    key = root / "_peer.key"
    assert len(key.read_bytes()) == 32
    assert stat.S_IMODE(key.stat().st_mode) == 0o600  # its owner's alone
    assert open_id(str(root)) == rid  # never replaced
    assert open_id(str(root), read_only=True) == rid


def test_every_spelling_of_one_directory_is_one_root(tmp_path, monkeypatch):
    real = tmp_path / "gpfs" / "home" / "run"
    rid = open_id(str(real))
    link = tmp_path / "home"
    link.symlink_to(tmp_path / "gpfs" / "home")
    monkeypatch.chdir(tmp_path)
    spellings = [
        str(link / "run"),  # through a symlink
        f"file://{real}",
        str(real) + "/",
        os.path.join("gpfs", "home", "run"),  # relative
        os.path.join("gpfs", "home", "..", "home", "run"),
    ]
    for spelling in spellings:
        assert open_id(spelling) == rid, spelling


def test_two_roots_never_share_an_id_whatever_their_names(tmp_path):
    root = tmp_path / "run"
    first = open_id(str(root))
    shutil.rmtree(root)  # the same name, a new root
    second = open_id(str(root))
    other = open_id(str(tmp_path / "other"))
    assert len({first, second, other}) == 3


def test_an_older_root_loads_and_gets_its_id_at_its_next_writable_open(tmp_path):
    root = tmp_path / "v4"
    shutil.copytree(FIXTURES / "format_v4", root)
    assert not (root / "_root.json").exists()

    async def main(**kw: object) -> tuple[str | None, list[int], dict]:
        async with AsyncCheckpointManager(str(root), **kw) as mgr:  # type: ignore[arg-type]
            return mgr.root_id, await mgr.steps(), await mgr.load()

    rid, steps, _ = anyio.run(lambda: main(read_only=True))
    assert rid is None
    assert not (root / "_root.json").exists()  # a reader writes nothing
    rid, steps_after, state = anyio.run(main)
    assert rid is not None
    assert steps_after == steps
    assert isinstance(state, dict)
    assert anyio.run(lambda: main(read_only=True))[0] == rid


def test_a_root_file_that_is_not_an_identity_fails_the_open_and_stays(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / "_root.json").write_text('{"id": "not hex"}')
    with pytest.raises(CorruptCheckpointError, match="not an aiockpt root identity"):
        open_id(str(root))
    assert (root / "_root.json").read_text() == '{"id": "not hex"}'


def test_steps_saved_before_and_after_the_id_load_alike(tmp_path):
    root = str(tmp_path / "run")
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.arange(4.0)}).result()
    with CheckpointManager(root) as mgr:
        assert torch.equal(mgr.load()["w"], torch.arange(4.0))


def test_ranks_giving_one_host_id_on_two_machines_are_named():
    from aiockpt._trainer.supervisor import _machines

    hosts = ("a", "a", "b", "b")
    assert _machines(hosts, ["m1", "m1", "m1", "m1"]) == []  # two simulated hosts on one machine
    (problem,) = _machines(hosts, ["m1", "m2", "m1", "m1"])
    assert "ranks [0, 1] give the host id 'a' but are on 2 machines" in problem
