"""Safetensors sources as users have them: the Hugging Face hub cache (files that are links
into its blobs), a folder of shards with no index, headers whose shapes no tensor can have,
and ``aiockpt.load_safetensors``, which needs no manager and no checkpoint root."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import os
import struct
from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import save_file

import aiockpt
from aiockpt import AsyncCheckpointManager
from aiockpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LoadMismatchError,
)
from aiockpt.storage import LocalStorage, UnsafeFileError


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(11, 6, generator=g),
        "layers.0.weight": torch.randn(6, 6, generator=g).to(torch.bfloat16),
        "layers.0.bias": torch.randn(6, generator=g),
        "layers.1.weight": torch.randn(6, 6, generator=g),
        "steps": torch.arange(5, dtype=torch.int64),
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def load(root: str, source, **kw):
    async def main():
        async with AsyncCheckpointManager(root) as mgr:
            return await mgr.load_safetensors(source, **kw)

    return anyio.run(main)


# ----------------------------------------------------------------- the hub cache


def hub_snapshot(cache: Path, files: dict[str, bytes], rev: str = "0123abcd") -> Path:
    """A model in the Hugging Face hub cache's layout: each file's bytes in
    ``blobs/<sha256>``, and ``snapshots/<rev>/<name>`` a relative link to it."""
    repo = cache / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / digest).write_bytes(data)
        os.symlink(f"../../blobs/{digest}", snap / name)
    return snap


def safetensors_bytes(tmp: Path, want: dict[str, torch.Tensor]) -> bytes:
    save_file(want, str(tmp / "staging.safetensors"))
    data = (tmp / "staging.safetensors").read_bytes()
    (tmp / "staging.safetensors").unlink()
    return data


def test_a_hub_cache_snapshot_of_one_file_loads_through_its_links(tmp_path, root):
    want = tensors()
    snap = hub_snapshot(tmp_path / "hub", {"model.safetensors": safetensors_bytes(tmp_path, want)})
    assert (snap / "model.safetensors").is_symlink()
    assert same(load(root, str(snap)), want)
    assert same(load(root, str(snap / "model.safetensors")), want)
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    load(root, str(snap), into=target)
    assert same(target, want)


def test_a_sharded_hub_cache_snapshot_loads_its_index_and_shards_through_links(tmp_path, root):
    want = tensors()
    first = {k: v for k, v in want.items() if k.startswith(("embed", "steps"))}
    second = {k: v for k, v in want.items() if k not in first}
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in want.values())},
        "weight_map": {k: names[0] if k in first else names[1] for k in want},
    }
    snap = hub_snapshot(
        tmp_path / "hub",
        {
            names[0]: safetensors_bytes(tmp_path, first),
            names[1]: safetensors_bytes(tmp_path, second),
            "model.safetensors.index.json": json.dumps(index).encode(),
        },
    )
    assert (snap / "model.safetensors.index.json").is_symlink()
    assert same(load(root, str(snap)), want)


def test_the_snapshot_as_a_checkpoint_root_still_refuses_its_links(tmp_path):
    """Following links is for a source the user names; a root aiockpt writes and deletes in
    still never reaches a file through one."""
    snap = hub_snapshot(tmp_path / "hub", {"model.safetensors": b"\0" * 16})
    storage = LocalStorage(str(snap))
    try:
        with pytest.raises(UnsafeFileError, match="symbolic link"):
            storage.read_range("model.safetensors", 0, 8)
    finally:
        storage.close()


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_source_link_to_anything_but_a_regular_file_is_refused(tmp_path, root, kind):
    folder = tmp_path / "model"
    folder.mkdir()
    if kind == "fifo":
        os.mkfifo(tmp_path / "pipe")  # opened to read, it would wait for a writer forever
        os.symlink(tmp_path / "pipe", folder / "model.safetensors")
    elif kind == "device":
        os.symlink("/dev/zero", folder / "model.safetensors")
    else:
        (tmp_path / "dir").mkdir()
        os.symlink(tmp_path / "dir", folder / "model.safetensors")
    with pytest.raises(UnsafeFileError, match="not a regular file"):
        load(root, str(folder))
    with pytest.raises(UnsafeFileError, match="not a regular file"):
        load(root, str(folder / "model.safetensors"))


def test_a_dangling_link_is_not_there(tmp_path, root):
    folder = tmp_path / "model"
    folder.mkdir()
    os.symlink(tmp_path / "gone.safetensors", folder / "model.safetensors")
    with pytest.raises(CheckpointNotFoundError):
        load(root, str(folder / "model.safetensors"))


# ----------------------------------------------------------------- shards with no index


def test_a_folder_of_shards_without_an_index_loads_every_shard(tmp_path, root):
    want = tensors()
    keys = sorted(want)
    folder = tmp_path / "dcp"
    folder.mkdir()
    for name, part in [
        ("model-00001-of-00003.safetensors", keys[:2]),
        ("model-00002-of-00003.safetensors", keys[2:4]),
        ("other.safetensors", keys[4:]),
    ]:
        save_file({k: want[k] for k in part}, str(folder / name))
    (folder / "notes.txt").write_text("not a shard")
    assert same(load(root, str(folder)), want)
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    load(root, str(folder), into=target)
    assert same(target, want)


def test_a_tensor_in_two_shards_without_an_index_is_refused_naming_both(tmp_path, root):
    folder = tmp_path / "dcp"
    folder.mkdir()
    save_file({"a": torch.ones(2), "w": torch.ones(3)}, str(folder / "first.safetensors"))
    save_file({"w": torch.zeros(3), "b": torch.ones(2)}, str(folder / "second.safetensors"))
    target = {"a": torch.zeros(2), "b": torch.zeros(2), "w": torch.full((3,), 7.0)}
    with pytest.raises(CorruptCheckpointError) as e:
        load(root, str(folder), into=target)
    message = str(e.value)
    assert "'w'" in message
    assert str(folder / "first.safetensors") in message
    assert str(folder / "second.safetensors") in message
    assert torch.equal(target["w"], torch.full((3,), 7.0))


def test_an_index_or_model_safetensors_still_decides_over_other_shards(tmp_path, root):
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, str(folder / "model.safetensors"))
    save_file({"w": torch.zeros(2)}, str(folder / "stray.safetensors"))
    got = load(root, str(folder))
    assert same(got, {"w": torch.ones(2)})


# ----------------------------------------------------------------- shapes no tensor can have


def raw_file(path: Path, header: dict, data: bytes = b"\0" * 64) -> str:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


@pytest.mark.parametrize(
    "shape", [[2**40, 2**40, 0], [2**40, 2**40, 2], [2**31, 2**31, 2, 0], [1, 2**62, 2, 0]]
)
def test_a_shape_whose_product_overflows_int64_is_corrupt_naming_file_and_tensor(
    tmp_path, root, shape
):
    path = raw_file(
        tmp_path / "huge.safetensors",
        {
            "fine": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "vast.weight": {"dtype": "F32", "shape": shape, "data_offsets": [8, 8]},
        },
    )
    for into in (None, {"fine": torch.zeros(2), "vast.weight": torch.zeros(0)}):
        with pytest.raises(CorruptCheckpointError, match="int64") as e:
            load(root, path, into=into)
        assert path in str(e.value)
        assert "'vast.weight'" in str(e.value)
        assert e.value.key == "vast.weight"


def test_a_zero_sized_shape_that_fits_int64_still_loads(tmp_path, root):
    path = raw_file(
        tmp_path / "empty.safetensors",
        {"e": {"dtype": "F32", "shape": [0, 2**40, 2**20], "data_offsets": [0, 0]}},
    )
    got = load(root, path)
    assert got["e"].shape == (0, 2**40, 2**20)


# ----------------------------------------------------------------- aiockpt.load_safetensors


def test_the_module_function_is_exported_and_async():
    assert "load_safetensors" in aiockpt.__all__
    assert inspect.iscoroutinefunction(aiockpt.load_safetensors)
    params = inspect.signature(aiockpt.load_safetensors).parameters
    assert list(params) == ["source", "into", "rename", "dtype", "storage_options"]
    assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in list(params)[2:])


def test_the_module_function_loads_without_a_manager_or_a_root(tmp_path, monkeypatch):
    """No manager is opened by the caller and no root is named: nothing is created, not
    even the default root under the working directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("AIOCKPT_ROOT", raising=False)
    want = tensors()
    save_file(want, str(tmp_path / "m.safetensors"))
    before = sorted(p.name for p in tmp_path.iterdir())

    async def main():
        whole = await aiockpt.load_safetensors(tmp_path / "m.safetensors")
        renamed = await aiockpt.load_safetensors(
            str(tmp_path / "m.safetensors"),
            rename=lambda n: None if n == "steps" else f"model.{n}",
            dtype=torch.float32,
        )
        target = {k: torch.zeros_like(v) for k, v in want.items()}
        # The folder holds no model.safetensors: its one .safetensors file is loaded.
        into = await aiockpt.load_safetensors(str(tmp_path), into=target)
        return whole, renamed, target, into

    whole, renamed, target, into = anyio.run(main)
    assert same(whole, want)
    assert set(renamed) == {f"model.{k}" for k in want if k != "steps"}
    assert renamed["model.layers.0.weight"].dtype == torch.float32
    assert torch.equal(renamed["model.layers.0.weight"], want["layers.0.weight"].float())
    assert into is target
    assert same(target, want)
    assert list(cwd.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # the source's folder too


def test_the_module_function_runs_under_plain_asyncio_run(tmp_path):
    want = tensors()
    save_file(want, str(tmp_path / "m.safetensors"))
    assert same(asyncio.run(aiockpt.load_safetensors(str(tmp_path / "m.safetensors"))), want)


def test_the_module_function_is_strict_as_the_method_is(tmp_path):
    save_file(tensors(), str(tmp_path / "m.safetensors"))
    target = {"embed.weight": torch.zeros(11, 6)}
    with pytest.raises(LoadMismatchError, match="steps"):
        anyio.run(lambda: aiockpt.load_safetensors(str(tmp_path / "m.safetensors"), into=target))
    assert torch.equal(target["embed.weight"], torch.zeros(11, 6))
    with pytest.raises(CheckpointNotFoundError):
        anyio.run(lambda: aiockpt.load_safetensors(str(tmp_path / "absent.safetensors")))
    with pytest.raises(TypeError):
        anyio.run(lambda: aiockpt.load_safetensors(str(tmp_path), dtype="float32"))
    with pytest.raises(ValueError, match="storage_options"):
        anyio.run(lambda: aiockpt.load_safetensors(str(tmp_path), storage_options={"anon": True}))


def test_the_module_function_passes_storage_options_to_the_source(tmp_path, test_storages):
    """``vanishing://`` cannot be opened without its ``vanish`` option: the options reach
    the storage the source is read from."""
    want = tensors()
    save_file(want, str(tmp_path / "m.safetensors"))
    url = f"vanishing://{tmp_path}/m.safetensors"
    options = {"vanish": str(tmp_path / "no-such-flag")}
    got = anyio.run(lambda: aiockpt.load_safetensors(url, storage_options=options))
    assert same(got, want)
    with pytest.raises(CheckpointError, match="vanish"):  # the storage could not be opened
        anyio.run(lambda: aiockpt.load_safetensors(url))
