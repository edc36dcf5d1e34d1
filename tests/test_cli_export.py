"""``aiockpt export``, and ``show`` and ``verify`` of checkpoints with distributed tensors, run
through the installed entry point on checkpoints saved by real FSDP2 ranks."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import crc32c
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from _export_worker import model, save
from _support.ranks import run_ranks
from _support.roots import flip_byte
from safetensors import safe_open
from safetensors.torch import load_file

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt
from aiockpt._core.chunks import Chunk
from aiockpt._core.dtable import ChunkRecord, block_crcs
from aiockpt._export import parse_size
from aiockpt.cli.verify import ChunkBlocks

SCRIPT = str(Path(sys.executable).parent / "aiockpt")
FIXTURES = Path(__file__).parent / "fixtures"
STEP = fmt.step_dirname(1)


def aiockpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SCRIPT, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[str, dict]:
    """Step 1 of a real 2-rank FSDP2 run (uneven rows, a Shard(1) tensor, an optimizer, and
    a plain tensor that differs between the ranks), and what rank 0 saw it save."""
    base = tmp_path_factory.mktemp("two-ranks")
    root = str(base / "run")
    saved = run_ranks("_export_worker.py", "save", 2, base, root, args={"per_rank": True})
    return root, saved[0]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[str, dict]:
    """The same state saved by this process alone, on a gloo group of one."""
    base = tmp_path_factory.mktemp("one-rank")
    root = str(base / "run")
    dist.init_process_group("gloo", init_method=f"file://{base}/store", rank=0, world_size=1)
    try:
        saved = anyio.run(save, 0, 1, root, {})
    finally:
        dist.destroy_process_group()
    return root, saved


@pytest.fixture
def copy_of(two_ranks, tmp_path):
    """A private copy of the 2-rank run, free to corrupt."""
    dest = tmp_path / "copy"
    shutil.copytree(two_ranks[0], dest)
    return str(dest)


def same(t: torch.Tensor, saved: dict) -> bool:
    return str(t.dtype) == saved["dtype"] and t.float().tolist() == saved["values"]


def manifest_path(root: str) -> str:
    return os.path.join(root, STEP, fmt.MANIFEST)


def shard_file(root: str, rank: int) -> str:
    """Rank ``rank``'s shard file, as the manifest names it."""
    with open(manifest_path(root)) as f:
        return next(s["file"] for s in json.load(f)["shards"] if s["rank"] == rank)


def flip_tensor_byte(root: str, rank: int, name: str) -> None:
    shard = shard_file(root, rank)
    with open(manifest_path(root)) as f:
        start, _ = json.load(f)["tensors"][shard][name]["byte_range"]
    flip_byte(os.path.join(root, STEP, shard), start + 1)


# --------------------------------------------------------------------------- export


def test_an_fsdp_export_loads_strictly_into_the_unsharded_model(two_ranks, tmp_path):
    root, saved = two_ranks
    out = tmp_path / "model.safetensors"
    r = aiockpt("export", root, str(out), "--step", "1", "--prefix", "model")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"wrote 4 tensors (172 B) to {out}\n"
    net = model()
    net.load_state_dict(load_file(out), strict=True)
    state = net.state_dict()
    assert set(state) == set(saved["model"])
    for name, value in state.items():
        assert same(value, saved["model"][name]), name
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_an_export_without_prefix_names_tensors_by_their_key_path(one_rank, tmp_path):
    root, saved = one_rank
    out = tmp_path / "all.safetensors"
    r = aiockpt("export", root, str(out), "--step", "1")
    assert r.returncode == 0, r.stderr
    got = load_file(out)
    expect = {
        **{f"model/{k}": v for k, v in saved["model"].items()},
        **{f"optim/{k}": v for k, v in saved["optim"].items()},
        **{f"extra/{k}": v for k, v in saved["extra"].items()},
    }
    assert set(got) == set(expect)
    for name, value in got.items():
        assert same(value, expect[name]), name


def test_a_prefix_exports_the_subtree_under_it(two_ranks, tmp_path):
    root, saved = two_ranks
    for prefix, expect in [
        ("extra", saved["extra"]),
        (
            "optim/state/0/",
            {
                k[len("state/0/") :]: v
                for k, v in saved["optim"].items()
                if k.startswith("state/0/")
            },
        ),
    ]:
        out = tmp_path / f"{prefix.strip('/').replace('/', '-')}.safetensors"
        r = aiockpt("export", root, str(out), "--step", "1", "--prefix", prefix)
        assert r.returncode == 0, r.stderr
        got = load_file(out)
        assert set(got) == set(expect)
        assert all(same(value, expect[name]) for name, value in got.items())


def test_max_shard_size_writes_the_hugging_face_layout(two_ranks, tmp_path):
    root, saved = two_ranks
    out = tmp_path / "hf"
    r = aiockpt(
        "export", root, str(out), "--step", "1", "--prefix", "model", "--max-shard-size", "70B"
    )
    assert r.returncode == 0, r.stderr
    # In tree order, each file up to 70 bytes of tensors unless one tensor is larger:
    # 0.weight 80 | 0.bias 20 | 2.weight 60 | 2.bias 12.
    names = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert sorted(os.listdir(out)) == [*names, "model.safetensors.index.json"]
    assert r.stdout == f"wrote 4 tensors (172 B) in 4 files to {out}\n"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index == {
        "metadata": {"total_size": 172},
        "weight_map": {
            "0.bias": names[1],
            "0.weight": names[0],
            "2.bias": names[3],
            "2.weight": names[2],
        },
    }
    merged = {}
    for name in names:
        part = load_file(out / name)
        assert {index["weight_map"][k] for k in part} == {name}
        merged.update(part)
    net = model()
    net.load_state_dict(merged, strict=True)
    assert all(same(v, saved["model"][k]) for k, v in net.state_dict().items())


def test_max_shard_size_that_fits_everything_writes_one_file_in_the_directory(two_ranks, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()  # an empty directory may be there already
    r = aiockpt(
        "export",
        two_ranks[0],
        str(out),
        "--step",
        "1",
        "--prefix",
        "model",
        "--max-shard-size",
        "5GB",
    )
    assert r.returncode == 0, r.stderr
    assert os.listdir(out) == ["model.safetensors"]
    model().load_state_dict(load_file(out / "model.safetensors"), strict=True)


def tied_model() -> torch.nn.Module:
    """An embedding and an output layer that share one weight, as language models tie them,
    with an untied layer between them."""
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    return torch.nn.Sequential(emb, torch.nn.Linear(4, 4), head)


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """Step 1 of a run of a model with tied weights, and the model's state dict."""
    root = str(tmp_path_factory.mktemp("tied") / "run")
    torch.manual_seed(0)
    net = tied_model()

    async def save_it() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, {"model": net, "step": 1}))

    anyio.run(save_it)
    return root, {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_a_tied_tensor_is_written_once_and_its_other_names_are_said(tied, tmp_path):
    root, state = tied
    out = tmp_path / "model.safetensors"
    r = aiockpt("export", root, str(out), "--prefix", "model")
    assert r.returncode == 0, r.stderr
    # 160 B of embedding and 80 B of the middle layer: the head's 160 B are not written again.
    assert r.stdout.splitlines() == [
        f"wrote 3 tensors (240 B) to {out}",
        "tied: 2.weight is 0.weight (written once, as 0.weight)",
    ]
    with safe_open(str(out), "pt") as f:
        assert sorted(f.keys()) == ["0.weight", "1.bias", "1.weight"]
        # As safetensors.torch.save_model records the names it drops: {dropped: kept}.
        assert f.metadata() == {"format": "pt", "2.weight": "0.weight"}
    header = 8 + int.from_bytes(out.read_bytes()[:8], "little")
    assert out.stat().st_size == header + 240

    # safetensors' own loader of a model ties the names back and loads it strictly ...
    net = tied_model()
    missing, unexpected = safetensors.torch.load_model(net, str(out), strict=True)
    assert (missing, unexpected) == (set(), [])
    for name, value in net.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert net[0].weight is net[2].weight
    # ... and a plain load_state_dict misses only the tied name, whose parameter it loaded.
    net = tied_model()
    result = net.load_state_dict(load_file(out), strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["2.weight"], [])
    assert torch.equal(net[2].weight, state["2.weight"])

    r = aiockpt("export", root, str(tmp_path / "all.safetensors"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1] == (
        "tied: model/2.weight is model/0.weight (written once, as model/0.weight)"
    )
    with safe_open(str(tmp_path / "all.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["model/0.weight", "model/1.bias", "model/1.weight"]
        assert f.metadata()["model/2.weight"] == "model/0.weight"


def test_a_sharded_export_maps_only_the_names_it_wrote(tied, tmp_path):
    root, state = tied
    out = tmp_path / "hf"
    r = aiockpt("export", root, str(out), "--prefix", "model", "--max-shard-size", "100B")
    assert r.returncode == 0, r.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    # As save_pretrained writes it: the tied name is left out of the files and the map.
    assert index["metadata"] == {"total_size": 240}
    assert sorted(index["weight_map"]) == ["0.weight", "1.bias", "1.weight"]
    with safe_open(str(out / index["weight_map"]["0.weight"]), "pt") as f:
        assert f.metadata() == {"format": "pt", "2.weight": "0.weight"}
    with safe_open(str(out / index["weight_map"]["1.weight"]), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    loaded: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        loaded |= load_file(out / name)
    assert sorted(loaded) == ["0.weight", "1.bias", "1.weight"]
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)


def test_a_version_1_checkpoint_exports(tmp_path):
    out = tmp_path / "v1.safetensors"
    r = aiockpt("export", str(FIXTURES / "format_v1"), str(out), "--step", "7", "--prefix", "model")
    assert r.returncode == 0, r.stderr
    got = load_file(out)
    assert set(got) == {"w", "b", "i", "m"}
    assert torch.equal(got["w"], torch.arange(6.0).view(2, 3))
    assert torch.equal(got["b"], torch.ones(3, dtype=torch.float16))
    assert torch.equal(got["i"], torch.tensor([1, -2, 3]))
    assert torch.equal(got["m"], torch.tensor([True, False]))


def test_plain_tensors_that_differ_between_ranks_are_refused(two_ranks, tmp_path):
    out = tmp_path / "all.safetensors"
    r = aiockpt("export", two_ranks[0], str(out), "--step", "1")
    assert r.returncode == 2
    assert "these plain tensors differ between them" in r.stderr
    assert ": rng (--prefix" in r.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-shard-size", "5XB"], "argument --max-shard-size: not a size: '5XB'"),
        (["--max-shard-size", "abc"], "argument --max-shard-size: not a size: 'abc'"),
        (["--max-shard-size=-1MB"], "argument --max-shard-size: not a size: '-1MB'"),
        (["--max-shard-size", "0"], "a size must be at least 1 byte, not '0'"),
        (
            ["--prefix", "nope"],
            "step 1 holds no tensors under the prefix 'nope' (its tensors "
            "are under: extra, model, optim, rng)",
        ),
        (["--step", "9"], "step 9 is not a committed checkpoint"),
    ],
)
def test_mistakes_exit_2_with_one_line_and_write_nothing(two_ranks, tmp_path, extra, message):
    out = tmp_path / "out"
    args = ["export", two_ranks[0], str(out), *extra]
    r = aiockpt(*(args if "--step" in extra else [*args, "--step", "1"]))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("aiockpt: error: ")
    assert message in r.stderr
    assert len(r.stderr.splitlines()) == 1
    assert os.listdir(tmp_path) == []


def test_export_takes_the_newest_step_by_default_and_needs_room(two_ranks, tmp_path):
    r = aiockpt("export", two_ranks[0], str(tmp_path / "x"), "--prefix", "model")
    assert r.returncode == 0, r.stderr
    assert "0.weight" in load_file(str(tmp_path / "x"))  # step 1, the only one
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("mine")
    r = aiockpt(
        "export",
        two_ranks[0],
        str(full),
        "--step",
        "1",
        "--prefix",
        "model",
        "--max-shard-size",
        "1MB",
    )
    assert r.returncode == 2
    assert "exists and is not an empty directory" in r.stderr
    r = aiockpt("export", two_ranks[0], str(full), "--step", "1", "--prefix", "model")
    assert r.returncode == 2
    assert "is a directory; OUT is the file to write" in r.stderr
    assert os.listdir(full) == ["keep"]


def test_sizes_parse_in_decimal_and_binary_units():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("10KiB") == 10 * 1024
    assert parse_size("1.5gib") == 3 * 2**29
    assert parse_size("4096") == parse_size("4096 B") == 4096
    for bad in ("", "MB", "5 XB", "1e3", "0.1"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


def test_a_corrupt_chunk_fails_the_export_and_leaves_nothing(copy_of, tmp_path):
    flip_tensor_byte(copy_of, 1, "extra/cols")
    outs = tmp_path / "outs"
    outs.mkdir()
    for extra in ([], ["--max-shard-size", "40B"]):
        r = aiockpt("export", copy_of, str(outs / "x"), "--step", "1", "--prefix", "extra", *extra)
        assert r.returncode == 1
        assert (
            f"{shard_file(copy_of, 1)}: the chunk of 'extra/cols' at [0, 4] failed its crc32c"
            in r.stderr
        )
        assert os.listdir(outs) == []


def test_a_corrupt_plain_tensor_fails_the_export(copy_of, tmp_path):
    flip_tensor_byte(copy_of, 0, "extra/half")
    r = aiockpt("export", copy_of, str(tmp_path / "x"), "--step", "1", "--prefix", "extra")
    assert r.returncode == 1
    assert f"{shard_file(copy_of, 0)}: tensor 'extra/half' failed its crc32c check" in r.stderr
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- show and verify


def test_show_lists_each_distributed_tensor_once_with_its_placements(two_ranks):
    r = aiockpt("show", two_ranks[0], "--step", "1")
    assert r.returncode == 0, r.stderr
    assert aiockpt("show", two_ranks[0], "1").stdout == r.stdout
    head, rest = r.stdout.split("\ndistributed tensors (14, 672 B)\n")
    assert head.splitlines()[0].endswith("world size 2")
    table, ranks = rest.split("\n\n", 1)
    rows = table.splitlines()
    assert rows[0].split() == ["KEY", "DTYPE", "SHAPE", "PLACEMENTS", "MESH", "CHUNKS", "BYTES"]
    found = {}
    for line in rows[1:]:
        m = re.fullmatch(r"(\S+)\s+(\S+)\s+(\[.*?\])\s+(\[\S*\])\s+(\[\d+\])\s+(\d+)\s+(\d+)", line)
        assert m, line
        found[m[1]] = m.groups()[1:]
    assert found["model/0.weight"] == ("F32", "[5, 4]", "[Shard(dim=0)]", "[2]", "2", "80")
    assert found["extra/cols"] == ("F32", "[3, 7]", "[Shard(dim=1)]", "[2]", "2", "84")
    assert found["extra/ids"] == ("I64", "[9]", "[Shard(dim=0)]", "[2]", "2", "72")
    assert len(found) == 14  # the model's 4, the optimizer's 8 moments, cols and ids
    # Each rank's table lists its plain tensors, not the chunks it holds.
    for rank in (0, 1):
        title = f"rank {rank}: tensors (7, "
        assert title in ranks
        section = ranks.split(title)[1].split("\n\n")[0]
        assert "and 14 chunks of distributed tensors)" in section
        keys = [line.split()[0] for line in section.splitlines()[3:]]  # after the bytes line
        steps = [f"optim/state/{i}/step" for i in range(4)]
        assert keys == ["extra/half", "extra/none", *steps, "rng"]


def test_verify_checks_every_chunk_block_crc(copy_of):
    assert aiockpt("verify", copy_of).returncode == 0
    path = manifest_path(copy_of)
    with open(path) as f:
        m = json.load(f)
    chunk = m["dtensors"]["model/2.weight"]["chunks"][1]
    chunk["blocks"][0] ^= 1
    with open(path, "w") as f:
        json.dump(m, f)
    r = aiockpt("verify", copy_of, "--step", "1")
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        "step 1: CORRUPT",
        f"  {STEP}/{chunk['shard']}: distributed tensor 'model/2.weight': the chunk at "
        f"{chunk['offsets']} fails 1 of its 1 block crc32c checks (block 0)",
    ]


def test_verify_names_the_tensor_whose_chunk_bytes_flipped(copy_of):
    flip_tensor_byte(copy_of, 1, "extra/cols")
    r = aiockpt("verify", copy_of)
    assert r.returncode == 1
    shard = f"{STEP}/{shard_file(copy_of, 1)}"
    assert r.stdout.splitlines() == [
        "step 1: CORRUPT",
        f"  {shard}: whole-file crc32c mismatch",
        f"  {shard}: tensor 'extra/cols' crc32c mismatch",
        f"  {shard}: distributed tensor 'extra/cols': the chunk at [0, 4] fails 1 of its 1 "
        "block crc32c checks (block 0)",
    ]


def test_chunk_blocks_follow_blocks_across_pieces():
    """Blocks that straddle the pieces a shard is read in, and an empty chunk, check out."""
    data = memoryview(bytes(range(256)) * 4)
    chunks = []
    for name, lo, hi in [("a", 100, 450), ("empty", 450, 450), ("b", 450, 1024)]:
        blocks = tuple(block_crcs(data[lo:hi], 64))
        record = ChunkRecord(
            Chunk((lo,), (hi - lo,)), "s", lo, hi, crc32c.crc32c(data[lo:hi]), blocks
        )
        chunks.append((name, record))

    def check(table: list[tuple[str, ChunkRecord]], piece: int, upto: int = 1024) -> list[str]:
        blocks = ChunkBlocks(table, 64)
        for lo in range(0, upto, piece):
            blocks.update(lo, data[lo : min(lo + piece, upto)])
        return blocks.mismatches()

    assert check(chunks, 37) == check(chunks, 64) == check(chunks, 1024) == []
    b = chunks[2][1]
    altered = (*b.blocks[:3], b.blocks[3] ^ 1, *b.blocks[4:])
    table = [*chunks[:2], ("b", ChunkRecord(b.chunk, "s", b.start, b.end, b.crc32c, altered))]
    assert check(table, 37) == [
        "distributed tensor 'b': the chunk at [450] fails 1 of its 9 block crc32c checks (block 3)"
    ]
    assert check(table, 37, upto=700) == []  # a chunk not read whole: the shard check says why
