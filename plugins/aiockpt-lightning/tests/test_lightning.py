"""AiockptCheckpointIO with the real Lightning Trainer and aiockpt daemon, on the CPU."""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import subprocess
import sys
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any

import _train
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.parsing import AttributeDict

from aiockpt import UnsupportedValueError
from aiockpt_lightning import SAVES_PER_GLOBAL_STEP, AiockptCheckpointIO

pytestmark = [
    # Lightning 2.6's CombinedLoader (made by every fit) calls torch's deprecated LeafSpec;
    # nothing a Trainer is given avoids it.
    pytest.mark.filterwarnings(
        r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
    ),
]

HERE = Path(__file__).resolve().parent


class Recording(AiockptCheckpointIO):
    """The plugin, keeping a deep copy of each checkpoint dict Lightning hands it."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        self.saved: dict[str, dict[str, Any]] = {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        """Keep a copy, then save."""
        self.saved[os.path.abspath(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """``a`` and ``b`` equal, of the same types all the way down, tensors bit for bit."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, path
        assert a.shape == b.shape, path
        assert a.requires_grad == b.requires_grad, path
        bits = [t.detach().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(*bits), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, torch.Generator):
        assert torch.equal(a.get_state(), b.get_state()), path
    else:
        assert a == b, path


def pointers(dirpath: Path) -> dict[str, int]:
    """The aiockpt step each pointer file of ``dirpath`` names, by file name."""
    return {p.name: json.loads(p.read_text())["step"] for p in sorted(dirpath.iterdir())}


def committed_steps(root: Path) -> list[int]:
    """The root's committed steps, read as aiockpt's format defines them (a step directory
    with a manifest), so a root still open for writing can be looked at."""
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if (p / "manifest.json").exists())


# The in-process resume saves into a new directory, on purpose: Lightning warns that the top-k
# bookkeeping of the directory it resumed from is not carried over.
@pytest.mark.filterwarnings("ignore:The dirpath has changed from:UserWarning")
def test_resume_in_a_fresh_process_continues_bit_for_bit(tmp_path: Path) -> None:
    root, ckpts = tmp_path / "root", tmp_path / "ckpts"
    full = _train.run(str(tmp_path / "full-root"), str(tmp_path / "full-ckpts"), max_steps=24)
    # The run that is interrupted: stopped at step 16, the end of its second epoch (a
    # mid-epoch resume would restart the epoch: these batches come from no resumable loader).
    first = _train.run(str(root), str(ckpts), max_steps=16)
    assert first["losses"] == {k: v for k, v in full["losses"].items() if int(k) < 16}
    names = pointers(ckpts)
    assert names == {
        "epoch=0-step=4.ckpt": 4 * SAVES_PER_GLOBAL_STEP,
        "epoch=0-step=8.ckpt": 8 * SAVES_PER_GLOBAL_STEP,
        "epoch=1-step=12.ckpt": 12 * SAVES_PER_GLOBAL_STEP,
        "epoch=1-step=16.ckpt": 16 * SAVES_PER_GLOBAL_STEP,
        "last.ckpt": 16 * SAVES_PER_GLOBAL_STEP + 1,  # a second save at global step 16
    }

    # A fresh process resumes from the latest checkpoint (ckpt_path="last") and runs on.
    out = tmp_path / "resumed.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "_train.py"), str(root), str(ckpts), "24", "last", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads(out.read_text())
    assert resumed["losses"] == {k: v for k, v in full["losses"].items() if int(k) >= 16}
    for key in ("weights", "optimizer", "lr", "global_step"):
        assert resumed[key] == full[key], key
    assert pointers(ckpts)["last.ckpt"] == 24 * SAVES_PER_GLOBAL_STEP + 1
    # last.ckpt's earlier checkpoints went as it was overwritten.
    assert committed_steps(root) == sorted(pointers(ckpts).values())
    assert len(pointers(ckpts)) == 7

    # And here, from an explicit path, saving elsewhere: the same continuation from step 8.
    again = _train.run(str(root), str(tmp_path / "again"), 24, str(ckpts / "epoch=0-step=8.ckpt"))
    assert again["losses"] == {k: v for k, v in full["losses"].items() if int(k) >= 8}
    assert again["weights"] == full["weights"]
    assert again["optimizer"] == full["optimizer"]


def test_a_loaded_checkpoint_is_the_dict_lightning_saved(tmp_path: Path, plugin: Any) -> None:
    io = plugin(tmp_path / "root", Recording)
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=3, save_top_k=-1)
    torch.manual_seed(0)
    model = _train.Tiny()
    _train.trainer(io, 6, [callback]).fit(model, train_dataloaders=_train.Batches())
    assert len(io.saved) == 2
    for path, saved in io.saved.items():
        loaded = io.load_checkpoint(path)
        assert_same(saved, loaded)
        assert type(loaded["state_dict"]) is OrderedDict  # with the state dict's _metadata
        assert loaded["state_dict"]._metadata == saved["state_dict"]._metadata
    io.teardown()


def test_save_top_k_removes_pointers_and_their_checkpoints(tmp_path: Path, plugin: Any) -> None:
    root, best, linked = tmp_path / "root", tmp_path / "best", tmp_path / "linked"
    top_k = ModelCheckpoint(
        dirpath=best, monitor="loss", every_n_train_steps=2, save_top_k=2, save_last=True
    )
    latest = ModelCheckpoint(dirpath=linked, every_n_train_steps=3, save_top_k=1, save_last="link")
    io = plugin(root)
    torch.manual_seed(0)
    _train.trainer(io, 16, [top_k, latest]).fit(_train.Tiny(), train_dataloaders=_train.Batches())

    # What ModelCheckpoint keeps is what is on disk, and nothing else is left in the root.
    kept = {os.path.basename(p) for p in top_k.best_k_models}
    assert set(pointers(best)) == {*kept, "last.ckpt"}
    assert len(kept) == 2
    assert os.path.islink(linked / "last.ckpt")
    assert os.readlink(linked / "last.ckpt") == "epoch=1-step=15.ckpt"
    assert set(os.listdir(linked)) == {"epoch=1-step=15.ckpt", "last.ckpt"}
    named = set(pointers(best).values()) | set(pointers(linked).values())
    assert committed_steps(root) == sorted(named)
    for path in [*top_k.best_k_models, linked / "last.ckpt"]:
        assert io.load_checkpoint(path)["global_step"] in (2, 4, 6, 8, 10, 12, 14, 15, 16)
    assert io.load_checkpoint(linked / "last.ckpt")["global_step"] == 15

    # Removing a pointer removes its checkpoint; a link goes alone.
    io.remove_checkpoint(linked / "last.ckpt")
    io.remove_checkpoint(best / "last.ckpt")
    io.wait()
    assert set(pointers(best)) == kept
    assert len(committed_steps(root)) == 3
    io.teardown()


def test_deleting_a_checkpoint_keeps_what_later_ones_read_from_it(
    tmp_path: Path, plugin: Any
) -> None:
    # A tensor of 16 MiB, unchanged between two saves: the second checkpoint reads its bytes
    # from the first one's file (aiockpt deduplicates), as last.ckpt saved at the same global
    # step as a top-k checkpoint does.
    root, ckpts = tmp_path / "root", tmp_path / "ckpts"
    first, last = 8 * SAVES_PER_GLOBAL_STEP, 8 * SAVES_PER_GLOBAL_STEP + 1
    weights = torch.arange(4 << 20, dtype=torch.float32)
    io = plugin(root)
    io.save_checkpoint({"global_step": 8, "w": weights}, ckpts / "epoch=0-step=8.ckpt")
    io.wait()
    io.save_checkpoint({"global_step": 8, "w": weights}, ckpts / "last.ckpt")
    io.wait()
    manifest = json.loads((root / f"step_{last:012d}" / "manifest.json").read_text())
    sources = {b[2] for shard in manifest["shards"] for b in shard.get("blocks", [])}
    assert any(s.startswith(f"step_{first:012d}/") for s in sources)  # it reads from it
    io.remove_checkpoint(ckpts / "epoch=0-step=8.ckpt")  # as save_top_k does
    io.teardown()
    assert committed_steps(root) == [last]

    io = plugin(root)
    assert torch.equal(io.load_checkpoint(ckpts / "last.ckpt")["w"], weights)


def test_what_cannot_be_stored_is_refused_naming_every_key_path(
    tmp_path: Path, plugin: Any
) -> None:
    io = plugin(tmp_path / "root")
    checkpoint = {
        "global_step": 3,
        "state_dict": {"w": torch.zeros(2)},
        "hyper_parameters": {"activation": torch.nn.ReLU, "ok": 1},
        "callbacks": {"Counter": defaultdict(int, a=1)},
        "extra": [lambda x: x],
        "module": torch.nn.Linear(1, 1),
    }
    with pytest.raises(UnsupportedValueError) as e:
        io.save_checkpoint(checkpoint, tmp_path / "ckpts" / "bad.ckpt")
    assert [p for p, _ in e.value.problems] == [
        "hyper_parameters/activation",
        "callbacks/Counter",
        "extra/0",
        "module",
    ]
    message = str(e.value)
    assert "cannot be stored without pickle" in message
    assert "store dict(value)" in message
    assert "store value.state_dict()" in message
    io.teardown()
    assert not (tmp_path / "ckpts").exists()  # nothing was saved
    assert not (tmp_path / "root").exists()


def test_values_aiockpt_would_change_come_back_as_they_were(tmp_path: Path, plugin: Any) -> None:
    meta: OrderedDict[str, Any] = OrderedDict(w=torch.arange(3.0))
    meta._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    checkpoint: dict[str, Any] = {
        "global_step": 5,
        "epoch": 1,
        "state_dict": meta,
        "hyper_parameters": AttributeDict(lr=0.1, data=pathlib.PurePosixPath("data/train"), n=None),
        "keys": {0.5: "float", (1, "a"): "tuple", None: "none", True: "bool", 2: "int"},
        "clash": {0: "int zero", "0": "str zero"},
        "sets": [{1, 2}, frozenset({"a"})],
        "blobs": (b"\x00\x01", b"", bytearray(b"xy")),
        "types": [torch.bfloat16, torch.device("cpu"), Path("runs/x")],
        "grad": torch.ones(2, requires_grad=True),
        "param": torch.nn.Parameter(torch.zeros(1)),
        "numpy": [np.arange(4, dtype=np.int16), np.float32(1.5)],
        "rng": torch.Generator().manual_seed(7),
        "nan": float("nan"),
    }
    io = plugin(tmp_path / "root")
    io.save_checkpoint(checkpoint, tmp_path / "c.ckpt")
    loaded = io.load_checkpoint(tmp_path / "c.ckpt")  # waits for the commit
    assert_same(checkpoint, loaded)
    assert isinstance(loaded["param"], torch.nn.Parameter)
    assert loaded["sets"] == [{1, 2}, frozenset({"a"})]
    assert type(loaded["types"][2]) is type(Path("runs/x"))
    io.teardown()


def test_loading_what_is_not_a_checkpoint_of_this_root_says_why(
    tmp_path: Path, plugin: Any
) -> None:
    io = plugin(tmp_path / "root")
    with pytest.raises(FileNotFoundError, match="not found"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    (tmp_path / "torch.ckpt").write_bytes(b"PK\x03\x04 a torch.save zip")
    with pytest.raises(ValueError, match="not an aiockpt-lightning pointer"):
        io.load_checkpoint(tmp_path / "torch.ckpt")
    io.save_checkpoint({"global_step": 1}, tmp_path / "one.ckpt")
    io.teardown()
    other = plugin(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="use AiockptCheckpointIO"):
        other.load_checkpoint(tmp_path / "one.ckpt")
    with pytest.raises(ValueError, match="no retention policy"):
        AiockptCheckpointIO(tmp_path / "root", retention=object())
