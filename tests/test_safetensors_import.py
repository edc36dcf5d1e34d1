"""load_safetensors in one process: Hugging Face safetensors files and folders, read through
the daemon into new tensors or in place into a module or a mapping of tensors."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import save_file

from aiockpt import AsyncCheckpointManager, CheckpointManager
from aiockpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LoadMismatchError,
)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(11, 6, generator=g),
        "layers.0.weight": torch.randn(6, 6, generator=g, dtype=torch.float64),
        "layers.0.bias": torch.randn(6, generator=g).to(torch.bfloat16),
        "layers.0.count": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }


def load(root: str, source, **kw):
    async def main():
        async with AsyncCheckpointManager(root) as mgr:
            return await mgr.load_safetensors(source, **kw)

    return anyio.run(main)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.proj = torch.nn.Linear(6, 4)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))


def net_file(path: Path, seed: int = 1, dtype: torch.dtype = torch.float32) -> dict:
    torch.manual_seed(seed)
    sd = {k: v.clone() for k, v in Net().state_dict().items()}
    sd["steps"] = torch.tensor([4, 5, 6])
    save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}, str(path))
    return sd


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def test_a_file_round_trips_into_new_plain_tensors(tmp_path, root):
    want = tensors()
    save_file(want, str(tmp_path / "m.safetensors"))
    got = load(root, str(tmp_path / "m.safetensors"))
    assert set(got) == set(want)
    for k, v in want.items():
        assert type(got[k]) is torch.Tensor
        assert got[k].dtype == v.dtype
        assert got[k].shape == v.shape
        assert torch.equal(got[k], v), k


def test_a_folder_with_model_safetensors_and_a_file_url(tmp_path, root):
    want = tensors()
    save_file(want, str(tmp_path / "model.safetensors"))
    assert same(load(root, str(tmp_path)), want)
    assert same(load(root, f"file://{tmp_path}/model.safetensors"), want)


def test_a_module_is_filled_in_place(tmp_path, root):
    sd = net_file(tmp_path / "net.safetensors")
    torch.manual_seed(2)
    net = Net()
    weight = net.proj.weight
    assert load(root, str(tmp_path / "net.safetensors"), into=net) is net
    assert net.proj.weight is weight  # in place
    assert same(snapshot(net), sd)


def test_a_mapping_of_tensors_is_filled_in_place(tmp_path, root):
    want = tensors()
    save_file(want, str(tmp_path / "m.safetensors"))
    target = {k: torch.full_like(v, 0) for k, v in want.items()}
    ids = {k: id(v) for k, v in target.items()}
    load(root, str(tmp_path / "m.safetensors"), into=target)
    assert {k: id(v) for k, v in target.items()} == ids
    assert same(target, want)


def test_bf16_file_into_fp32_parameters_and_new_tensors_with_dtype(tmp_path, root):
    sd = net_file(tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    net = Net()
    load(root, str(tmp_path / "bf16.safetensors"), into=net, dtype=torch.float32)
    for k, v in net.state_dict().items():
        expect = sd[k].to(torch.bfloat16).to(torch.float32) if sd[k].is_floating_point() else sd[k]
        assert v.dtype == expect.dtype, k
        assert torch.equal(v, expect), k
    got = load(root, str(tmp_path / "bf16.safetensors"), dtype=torch.float32)
    assert got["proj.weight"].dtype == torch.float32
    assert got["steps"].dtype == torch.int64  # integers are never cast
    assert torch.equal(got["steps"], torch.tensor([4, 5, 6]))


def test_a_dtype_that_differs_without_dtype_is_refused(tmp_path, root):
    net_file(tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    net = Net()
    before = snapshot(net)
    with pytest.raises(LoadMismatchError, match=r"embed\.weight.*bfloat16.*dtype="):
        load(root, str(tmp_path / "bf16.safetensors"), into=net)
    assert same(snapshot(net), before)


def test_rename_strips_a_prefix_and_skips_names(tmp_path, root):
    sd = net_file(tmp_path / "x.safetensors")
    prefixed = {f"model.{k}": v for k, v in sd.items()}
    prefixed["lm_head.extra"] = torch.ones(2)
    save_file(prefixed, str(tmp_path / "p.safetensors"))

    def rename(name: str) -> str | None:
        return name.removeprefix("model.") if name.startswith("model.") else None

    net = Net()
    load(root, str(tmp_path / "p.safetensors"), into=net, rename=rename)
    assert same(snapshot(net), sd)
    got = load(root, str(tmp_path / "p.safetensors"), rename=rename)
    assert set(got) == set(sd)


def test_missing_and_extra_names_are_refused_naming_them(tmp_path, root):
    sd = net_file(tmp_path / "x.safetensors")
    del sd["proj.bias"]
    sd["surplus"] = torch.ones(3)
    save_file(sd, str(tmp_path / "odd.safetensors"))
    net = Net()
    before = snapshot(net)
    with pytest.raises(LoadMismatchError) as e:
        load(root, str(tmp_path / "odd.safetensors"), into=net)
    assert "proj.bias" in str(e.value)
    assert "surplus" in str(e.value)
    assert same(snapshot(net), before)


def test_a_shape_mismatch_names_the_key_and_leaves_the_target(tmp_path, root):
    sd = net_file(tmp_path / "x.safetensors")
    sd["proj.weight"] = torch.ones(5, 6)
    save_file(sd, str(tmp_path / "bad.safetensors"))
    net = Net()
    before = snapshot(net)
    with pytest.raises(LoadMismatchError, match=r"proj\.weight"):
        load(root, str(tmp_path / "bad.safetensors"), into=net)
    assert same(snapshot(net), before)


def test_two_names_renamed_to_one_key_are_refused(tmp_path, root):
    save_file({"a.w": torch.ones(2), "b.w": torch.ones(2)}, str(tmp_path / "t.safetensors"))
    with pytest.raises(LoadMismatchError, match="a.w.*b.w|b.w.*a.w"):
        load(root, str(tmp_path / "t.safetensors"), rename=lambda n: "w")


def test_a_source_that_is_not_there(tmp_path, root):
    with pytest.raises(CheckpointNotFoundError, match="nothing"):
        load(root, str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="model.safetensors"):
        load(root, str(tmp_path / "empty"))


def raw_file(path: Path, header: bytes | dict, data: bytes = b"\0" * 64) -> str:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


HOSTILE = {
    "out_of_range": {"w": {"dtype": "F32", "shape": [32], "data_offsets": [0, 128]}},
    "overlapping": {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    },
    "size_mismatch": {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}},
    "negative": {"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}},
    "unknown_dtype": {"w": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 16]}},
    "not_json": b"{not json",
    "not_an_object": b"[1, 2]",
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_a_corrupt_checkpoint(tmp_path, root, case):
    path = raw_file(tmp_path / "h.safetensors", HOSTILE[case])
    net = {"w": torch.zeros(4)}
    with pytest.raises(CorruptCheckpointError):
        load(root, path)
    with pytest.raises(CorruptCheckpointError):
        load(root, path, into=net)
    assert torch.equal(net["w"], torch.zeros(4))


def test_a_huge_header_length_is_refused_before_it_is_read(tmp_path, root):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(CorruptCheckpointError, match="header"):
        load(root, str(path))
    path.write_bytes(b"\1\2")
    with pytest.raises(CorruptCheckpointError):
        load(root, str(path))


def write_index(folder: Path, weight_map: dict) -> None:
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/abs.safetensors", "sub/x.safetensors"])
def test_index_shard_names_must_stay_in_the_folder(tmp_path, root, bad):
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    write_index(folder, {"w": bad})
    with pytest.raises(CorruptCheckpointError, match="index"):
        load(root, str(folder))


def test_an_index_naming_a_tensor_its_shard_lacks_is_corrupt(tmp_path, root):
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, str(folder / "model-00001-of-00001.safetensors"))
    write_index(
        folder, {"w": "model-00001-of-00001.safetensors", "v": "model-00001-of-00001.safetensors"}
    )
    with pytest.raises(CorruptCheckpointError, match="'v'"):
        load(root, str(folder))
    (folder / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(CorruptCheckpointError, match="index"):
        load(root, str(folder))


def test_a_sharded_transformers_folder_loads_into_a_fresh_model(tmp_path, root):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(config)
    saved.save_pretrained(str(tmp_path / "llama"), max_shard_size="20KB")
    shards = sorted((tmp_path / "llama").glob("model-*.safetensors"))
    assert len(shards) > 2
    assert (tmp_path / "llama" / "model.safetensors.index.json").exists()
    torch.manual_seed(1)
    fresh = transformers.LlamaForCausalLM(config)
    load(root, str(tmp_path / "llama"), into=fresh)
    want, got = saved.state_dict(), fresh.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_tied_weights_missing_from_the_file_are_filled_through_their_twin(tmp_path, root):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    saved = transformers.GPT2LMHeadModel(config)
    saved.save_pretrained(str(tmp_path / "gpt2"))
    torch.manual_seed(1)
    fresh = transformers.GPT2LMHeadModel(config)
    load(root, str(tmp_path / "gpt2"), into=fresh)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    for k, v in saved.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k


def test_errors_are_checkpoint_errors_and_bad_arguments_are_refused(tmp_path, root):
    save_file({"w": torch.ones(2)}, str(tmp_path / "t.safetensors"))
    with pytest.raises(CheckpointError):
        load(root, str(tmp_path / "t.safetensors"), into={"w": "not a tensor"})
    with pytest.raises(TypeError):
        load(root, str(tmp_path / "t.safetensors"), dtype="float32")
    with pytest.raises(TypeError):
        load(root, str(tmp_path / "t.safetensors"), rename="w")


def test_the_sync_manager_loads_safetensors(tmp_path, root):
    sd = net_file(tmp_path / "net.safetensors")
    net = Net()
    with CheckpointManager(root) as mgr:
        assert mgr.load_safetensors(str(tmp_path / "net.safetensors"), into=net) is net
        got = mgr.load_safetensors(str(tmp_path / "net.safetensors"))
    assert same(snapshot(net), sd)
    assert same(got, sd)


def big_tensors() -> dict[str, torch.Tensor]:
    """Tensors over the 8 MiB pieces both sides read in, at offsets not page-aligned."""
    g = torch.Generator().manual_seed(3)
    return {
        "a.bias": torch.randn(7, generator=g),  # puts what follows off the page boundary
        "b.weight": torch.randn(2600, 1000, generator=g),  # 10.4 MB: two pieces and a bit
        "c.weight": torch.randn(1100, 2000, generator=g).to(torch.bfloat16),
        "d.weight": torch.randn(300, 7, generator=g, dtype=torch.float64),
    }


def test_large_tensors_read_in_pieces_round_trip_and_outlive_the_manager(tmp_path, root):
    import gc

    want = big_tensors()
    save_file(want, str(tmp_path / "m.safetensors"))
    got = load(root, str(tmp_path / "m.safetensors"))  # the manager is closed on return
    gc.collect()
    assert same(got, want)
    got["b.weight"].add_(1)  # the views are writable memory of their own
    assert torch.equal(got["b.weight"], want["b.weight"] + 1)


def test_strided_cast_and_contiguous_targets_are_filled_together(tmp_path, root):
    want = big_tensors()
    save_file(want, str(tmp_path / "m.safetensors"))
    target = {
        "a.bias": torch.zeros(7),
        "b.weight": torch.zeros(1000, 2600).t(),  # strided: copied from a mapping
        "c.weight": torch.zeros(1100, 2000),  # bf16 file, fp32 target: cast
        "d.weight": torch.zeros(300, 7),  # float64 file: cast
    }
    versions = {k: v._version for k, v in target.items()}
    load(root, str(tmp_path / "m.safetensors"), into=target, dtype=torch.float32)
    for k, v in want.items():
        assert torch.equal(target[k], v.float()), k
        assert target[k]._version > versions[k], k  # autograd sees every write


def test_an_import_is_recorded_as_load_events(tmp_path, root):
    """load.start and load.end (with the bytes read, and the source in ``detail``), or
    load.exception with the error, each under one uuid."""
    save_file(tensors(), str(tmp_path / "m.safetensors"))
    events = []

    async def main():
        async with AsyncCheckpointManager(root, event_handlers=[events.append]) as mgr:
            await mgr.load_safetensors(str(tmp_path / "m.safetensors"))
            with pytest.raises(LoadMismatchError):  # names the file's tensors it lacks
                await mgr.load_safetensors(str(tmp_path / "m.safetensors"), into={})

    anyio.run(main)
    loads = [e for e in events if e.name.startswith("load.")]
    assert [e.name for e in loads] == ["load.start", "load.end", "load.start", "load.exception"]
    start, end, again, failed = loads
    assert start.uuid == end.uuid != again.uuid == failed.uuid
    assert end.read_nbytes > 0
    assert end.nbytes > 0
    assert end.duration_s is not None
    assert all(e.detail and e.detail.endswith("m.safetensors") for e in loads)
    assert failed.error is not None
    assert failed.error["type"] == "aiockpt.errors.LoadMismatchError"


def _join(prefix: str) -> None:
    """Wait for this process's threads named ``prefix...`` (a segment's deferred release)."""
    import threading

    for t in threading.enumerate():
        if t.name.startswith(prefix):
            t.join()


def _segments_held(where: str, made_by: str = "") -> list[str]:
    """This process's load segments (made by process ``made_by``, any when empty) still open
    (``fd``) or mapped (``maps``)."""
    import os

    from aiockpt._core import shm

    if where == "fd":
        held = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the directory's own descriptor, gone
                held.append(os.readlink(f"/proc/self/fd/{fd}"))
    else:
        held = Path("/proc/self/maps").read_text().splitlines()
    return [h for h in held if f"/{shm.PREFIX}-{made_by}" in h and "-load-" in h]


def test_the_trainer_releases_the_segment_after_filling_the_targets(tmp_path, root):
    """Closing the segment (freeing its pages) is left to a thread once the targets are
    filled; it still happens, and a load that fails leaves nothing open either."""
    want = big_tensors()
    save_file(want, str(tmp_path / "m.safetensors"))
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    load(root, str(tmp_path / "m.safetensors"), into=target)
    _join("aiockpt-hf-free")
    assert same(target, want)
    assert _segments_held("fd") == []
    with pytest.raises(LoadMismatchError):
        load(root, str(tmp_path / "m.safetensors"), into={**target, "extra": torch.zeros(1)})
    _join("aiockpt-hf-free")
    assert _segments_held("fd") == []


def test_the_daemon_unmaps_the_segment_after_reading_it(tmp_path):
    """hfread.read hands the segment over neither mapped nor open, once its unmapping thread
    is done; the bytes it read are the file's."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from aiockpt._core import shm
    from aiockpt._daemon import hfread

    want = big_tensors()
    save_file(want, str(tmp_path / "m.safetensors"))
    source = hfread.Source(str(tmp_path / "m.safetensors"), {})
    segments: set[str] = set()
    try:
        info = hfread.describe(source)
        items = [(n, f, st, sh, s, None) for n, (f, st, sh, s, _) in info.tensors.items()]
        with ThreadPoolExecutor(2) as pool:
            reply = hfread.read(source, items, segments, pool)
        _join("aiockpt-hf-unmap")
        mine = f"{os.getpid()}-"
        assert _segments_held("maps", mine) == _segments_held("fd", mine) == []
        seg = shm.Segment.attach(reply.segment, reply.size)
        try:
            b = want["b.weight"]
            _, _, at = reply.tensors["b.weight"]
            got = torch.frombuffer(seg.buf, dtype=torch.float32, count=b.numel(), offset=at)
            assert torch.equal(got.view(b.shape), b)
            del got
        finally:
            seg.close()
    finally:
        for name in segments:
            shm.unlink(name)
        source.close()
