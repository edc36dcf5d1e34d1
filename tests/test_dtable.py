"""The manifest's table of distributed tensors: merging ranks' entries, refusing hostile tables,
and resharding any saved layout into any other, over simulated ranks in one process.

A simulated save computes every rank's chunk with torch's own placement arithmetic
(``_trainer.dtensor.chunk_at``, no process group needed), keeps the chunks the writing ranks
would write as in-memory shard files, merges the ranks' entries as rank 0's daemon does, and
parses the result as a reader would; a simulated load assembles each rank's box of another
random layout with the daemon's Assembler.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from aiockpt._core import dtable
from aiockpt._core import format as fmt
from aiockpt._core.chunks import Chunk, byte_span, read_plan
from aiockpt._core.reshard import Assembler, wanted_box
from aiockpt._trainer.dtensor import chunk_at, writes_at
from aiockpt._trainer.dtypes import TORCH_TO_ST
from aiockpt.errors import CorruptCheckpointError, LoadMismatchError

POOL = ThreadPoolExecutor(2)


def coordinates(mesh: tuple[int, ...]):
    for flat in range(math.prod(mesh)):
        coord, rest = [], flat
        for n in reversed(mesh):
            coord.append(rest % n)
            rest //= n
        yield tuple(reversed(coord))


class SimulatedSave:
    """What a save of ``full`` placed by ``placements`` on ``mesh`` leaves on storage."""

    def __init__(self, full: torch.Tensor, mesh: tuple[int, ...], placements, block: int):
        self.block = block
        self.files: dict[str, bytearray] = {}
        tensors: dict[str, dict[str, fmt.TensorRecord]] = {}
        parts = []
        dtype = TORCH_TO_ST[full.dtype]
        shape = tuple(full.shape)
        for rank, coord in enumerate(coordinates(mesh)):
            shard = fmt.shard_filename(rank)
            chunk = chunk_at(shape, mesh, coord, placements)
            data = bytearray()
            tensors[shard] = {}
            blocks = {}
            writes = writes_at(coord, placements) and chunk.numel > 0
            if writes:
                piece = full[tuple(slice(o, o + n) for o, n in zip(*chunk, strict=True))]
                data = bytearray(piece.contiguous().numpy().tobytes())
                tensors[shard]["w"] = fmt.TensorRecord(
                    shard, dtype, chunk.sizes, 0, len(data), crc32c.crc32c(data)
                )
                blocks["w"] = dtable.block_crcs(memoryview(data), block)
            self.files[shard] = data
            entry = dtable.RankEntry(
                "w", dtype, shape, tuple(map(repr, placements)), mesh, chunk if writes else None
            )
            parts.append((shard, dtable.rank_json([entry], blocks)))
        merged = dtable.merge(parts)
        assert merged is not None
        self.table = json.loads(merged)
        self.tensors = tensors
        self.record = dtable.parse_dtensors(self.table, tensors, block, path="m")["w"]
        self.read_bytes = 0

    def read(self, shard: str, offset: int, out: memoryview) -> None:
        out[:] = self.files[shard][offset : offset + len(out)]

    def load(self, box: Chunk, dtype: torch.dtype) -> tuple[torch.Tensor, Assembler]:
        out = bytearray(box.numel * torch.tensor([], dtype=dtype).element_size())
        asm = Assembler(self.read, POOL, self.block, lambda shard: shard)
        asm.fill(self.record, box, memoryview(out))
        asm.wait()
        t = torch.frombuffer(out, dtype=dtype) if out else torch.empty(0, dtype=dtype)
        return t.view(box.sizes), asm


def span_read(saved: dtable.ChunkRecord, box: Chunk, itemsize: int, block: int) -> int:
    runs = read_plan(saved.chunk, box, itemsize)
    if not runs:
        return 0
    lo, hi = byte_span(runs)
    return min(saved.nbytes, -(-hi // block) * block) - lo // block * block


@st.composite
def layouts(draw, ndim: int):
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    if math.prod(mesh) > 4:
        mesh = mesh[:1]
    choices = [Replicate()] + [Shard(d) for d in range(ndim)]
    placements = tuple(draw(st.sampled_from(choices)) for _ in mesh)
    return mesh, placements


@st.composite
def cases(draw):
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))
    saved = draw(layouts(len(shape)))
    loaded = draw(layouts(len(shape)))
    dtype = draw(st.sampled_from([torch.float32, torch.int16, torch.float64, torch.uint8]))
    block = draw(st.sampled_from([1, 4, 16, 64, 65536]))
    return shape, saved, loaded, dtype, block


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(cases())
def test_any_saved_layout_loads_into_any_other(case):
    shape, (mesh, placements), (mesh2, placements2), dtype, block = case
    full = (torch.arange(math.prod(shape)) % 251).to(dtype).view(shape)
    saved = SimulatedSave(full, mesh, placements, block)
    # Each element is stored once, whatever is replicated.
    stored = sum(len(f) for f in saved.files.values())
    assert stored == full.numel() * full.element_size()
    for coord in coordinates(mesh2):
        box = chunk_at(shape, mesh2, coord, placements2)
        got, asm = saved.load(box, dtype)
        want = full[tuple(slice(o, o + n) for o, n in zip(*box, strict=True))]
        assert torch.equal(got, want), (coord, box)
        # Each chunk is read at most over the one range that holds its runs (its gaps too,
        # when the overlap is strided), rounded out to whole blocks.
        assert asm.read_bytes <= sum(
            span_read(c, box, full.element_size(), block) for c in saved.record.chunks
        )


def test_a_dim0_reshard_reads_only_the_blocks_it_needs():
    full = torch.arange(64 * 1024, dtype=torch.float32).view(1024, 64)  # 256 KiB
    saved = SimulatedSave(full, (2,), (Shard(0),), 4096)
    for coord in coordinates((8,)):
        box = chunk_at((1024, 64), (8,), coord, (Shard(0),))
        got, asm = saved.load(box, torch.float32)
        assert torch.equal(got, full[box.offsets[0] : box.offsets[0] + box.sizes[0]])
        assert asm.read_bytes == asm.used_bytes  # rows of 256 B: 128 rows end on a block


def test_a_flipped_byte_fails_whole_and_partial_reads():
    full = torch.arange(4096, dtype=torch.float32).view(64, 64)
    saved = SimulatedSave(full, (2,), (Shard(0),), 1024)
    saved.files[fmt.shard_filename(1)][2000] ^= 1  # row 39, in the first 4 KiB of rank 1
    with pytest.raises(CorruptCheckpointError, match="crc32c"):
        saved.load(Chunk((0, 0), (64, 64)), torch.float32)  # reads the chunk whole
    with pytest.raises(CorruptCheckpointError, match="crc32c"):
        saved.load(Chunk((32, 0), (16, 64)), torch.float32)  # the blocks holding rows 32-47
    # Rows 48-63 lie in other blocks of that chunk: a read of only them never sees the flip.
    got, _ = saved.load(Chunk((48, 0), (16, 64)), torch.float32)
    assert torch.equal(got, full[48:])


def test_ranks_that_disagree_on_a_tensor_are_refused_by_the_merge():
    a = dtable.RankEntry("w", "F32", (4,), ("Shard(dim=0)",), (2,), Chunk((0,), (2,)))
    b = dtable.RankEntry("w", "F32", (6,), ("Shard(dim=0)",), (2,), Chunk((3,), (3,)))
    parts = [("s0", dtable.rank_json([a], {"w": [1]})), ("s1", dtable.rank_json([b], {"w": [2]}))]
    with pytest.raises(dtable.Disagreement, match="'w'") as caught:
        dtable.merge(parts)
    assert "on the shape of the distributed tensor 'w': rank 0: F32[4]" in str(caught.value)
    assert "; rank 1: F32[6] placed" in str(caught.value)
    assert dtable.merge([("s0", ""), ("s1", "")]) is None


def test_copies_of_a_submesh_agree_and_the_first_rank_of_other_ones_is_named():
    # A (dp, tp) = 2 x 2 mesh, the tensor on the dp sub-meshes {0, 2} and {1, 3}: every
    # rank's entry holds the sub-mesh's shape, not its ranks, so the copies agree.
    full = dtable.RankEntry("w", "F32", (5,), ("Shard(dim=0)",), (2,), None)
    first = dtable.RankEntry("w", "F32", (5,), ("Shard(dim=0)",), (2,), Chunk((0,), (3,)))
    second = dtable.RankEntry("w", "F32", (5,), ("Shard(dim=0)",), (2,), Chunk((3,), (2,)))
    texts = [
        dtable.rank_json([first], {"w": [1]}),
        dtable.rank_json([full], {}),
        dtable.rank_json([second], {"w": [2]}),
        dtable.rank_json([full], {}),
    ]
    merged = dtable.merge([(f"s{r}", t) for r, t in enumerate(texts)])
    assert merged is not None
    chunks = json.loads(merged)["w"]["chunks"]
    assert [(c["offsets"], c["shard"]) for c in chunks] == [([0], "s0"), ([3], "s2")]
    # Rank 2 with a different dtype, after a rank that saved nothing: named by its rank.
    other = dtable.RankEntry("w", "F64", (5,), ("Shard(dim=0)",), (2,), Chunk((3,), (2,)))
    texts[2] = dtable.rank_json([other], {"w": [2]})
    parts = [("s0", ""), *[(f"s{r + 1}", t) for r, t in enumerate(texts)]]
    with pytest.raises(dtable.Disagreement) as caught:
        dtable.merge(parts)
    assert str(caught.value) == (
        "the ranks disagree on the dtype of the distributed tensor 'w': rank 1: F32[5] placed "
        "['Shard(dim=0)'] on mesh [2]; rank 3: F64[5] placed ['Shard(dim=0)'] on mesh [2]"
    )


# --------------------------------------------------------------------------- hostile tables


def hostile(mutate) -> tuple[dict, dict]:
    saved = SimulatedSave(torch.arange(16.0).view(4, 4), (2,), (Shard(0),), 16)
    table = json.loads(json.dumps(saved.table))
    mutate(table["w"])
    return table, saved.tensors


def _set(key, value, chunk=0):
    def mutate(entry):
        entry["chunks"][chunk][key] = value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (_set("offsets", [1, 0]), "shard_r00000.safetensors holds it as|overlap|elements"),
        (_set("offsets", [3, 0], 1), "spans \\[3, 5\\) on dim 0"),
        (lambda e: e["chunks"].pop(), "chunks hold 8 elements of a tensor of shape \\[4, 4\\]"),
        (lambda e: e["chunks"].append(dict(e["chunks"][0])), "two chunks in"),
        (_set("shard", "shard_r00009.safetensors"), "does not list"),
        (_set("blocks", [0]), "bad block checksums"),
        (_set("sizes", [2, 3]), "holds it as F32\\[2, 4\\]"),
        (_set("sizes", [2.0, 4]), "holds it as F32\\[2, 4\\]"),
        (_set("offsets", [0, -1]), "bad offsets"),
        (_set("offsets", [0.0, 0]), "bad offsets"),
        (lambda e: e.update(dtype="Q8"), "unknown dtype"),
        (lambda e: e.update(dtype="I32"), "holds it as F32"),
        (lambda e: e.update(shape=[4, "4"]), "bad shape"),
        (lambda e: e.update(mesh=[0]), "bad mesh"),
        (lambda e: e.update(placements="Shard(0)"), "bad placements"),
        (lambda e: e.update(chunks={}), "chunks is not a list"),
    ],
)
@pytest.mark.parametrize("lazy", [False, True], ids=["parsed in full", "lazily, when loaded"])
def test_hostile_chunk_tables_are_refused_naming_the_tensor(mutate, why, lazy):
    table, tensors = hostile(mutate)
    with pytest.raises(CorruptCheckpointError, match=why) as info:
        load_whole(table, tensors, lazy=lazy)
    assert info.value.key == "w"


def load_whole(table: dict, tensors: dict, *, lazy: bool) -> None:
    """Parse the table and use its chunks as a load of the whole tensor does."""
    records = dtable.parse_dtensors(table, tensors, 16, path="m", lazy=lazy)
    records["w"].covering(Chunk((0, 0), (4, 4)))


def lazy_record(mutate) -> dtable.DTensorRecord:
    table, tensors = hostile(mutate)
    return dtable.parse_dtensors(table, tensors, 16, path="m", lazy=True)["w"]


def test_a_lazy_table_checks_the_chunks_a_box_uses_and_no_others():
    # Rank 1's chunk (rows 2-3) has a wrong number of block crcs: only boxes that need one of
    # its rows fail, and the whole table fails a full check.
    rec = lazy_record(_set("blocks", [0], chunk=1))
    top = rec.covering(Chunk((0, 0), (2, 4)))
    assert [c.chunk for c in top] == [Chunk((0, 0), (2, 4))]
    assert [c.chunk for c in rec.covering(Chunk((1, 1), (1, 2)))] == [Chunk((0, 0), (2, 4))]
    with pytest.raises(CorruptCheckpointError, match="chunk 1 has bad block checksums"):
        rec.covering(Chunk((1, 0), (2, 4)))
    with pytest.raises(CorruptCheckpointError, match="chunk 1 has bad block checksums"):
        rec.chunks  # noqa: B018


def test_a_lazy_table_refuses_a_box_it_does_not_cover_or_covers_twice():
    missing = lazy_record(lambda e: e["chunks"].pop())  # rows 2-3 saved nowhere
    assert len(missing.covering(Chunk((0, 0), (2, 4)))) == 1
    with pytest.raises(CorruptCheckpointError, match="chunks hold 8 elements"):
        missing.covering(Chunk((1, 0), (2, 4)))
    # Rank 1's chunk moved up a row: row 1 is held twice, row 3 by nobody.
    twice = lazy_record(_set("offsets", [1, 0], chunk=1))
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        twice.covering(Chunk((0, 0), (2, 4)))


def test_a_lazy_table_refuses_a_malformed_chunk_as_a_full_parse_does():
    for mutate in (lambda e: e["chunks"].append(3), _set("offsets", "01"), _set("sizes", None)):
        table, tensors = hostile(mutate)
        with pytest.raises(CorruptCheckpointError) as full:
            dtable.parse_dtensors(table, tensors, 16, path="m")
        with pytest.raises(CorruptCheckpointError) as lazy:
            dtable.parse_dtensors(table, tensors, 16, path="m", lazy=True)["w"].covering(
                Chunk((0, 0), (1, 1))
            )
        assert str(lazy.value) == str(full.value)


def test_overlapping_chunks_that_sum_to_the_whole_are_refused():
    # Two chunks of 2x4 rows each: [0, 2) and [1, 3); row 3 is missing, row 1 twice.
    full = torch.arange(16.0).view(4, 4)
    saved = SimulatedSave(full, (2,), (Shard(0),), 16)
    table = json.loads(json.dumps(saved.table))
    table["w"]["chunks"][1]["offsets"] = [1, 0]
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        dtable.parse_dtensors(table, saved.tensors, 16, path="m")


def test_bad_block_size_and_table_type_are_refused():
    with pytest.raises(CorruptCheckpointError, match="block_bytes"):
        dtable.parse_dtensors({}, {}, 0, path="m")
    with pytest.raises(CorruptCheckpointError, match="not an object"):
        dtable.parse_dtensors([], {}, 16, path="m")


def test_a_target_of_another_shape_or_dtype_is_a_load_mismatch():
    rec = SimulatedSave(torch.arange(16.0).view(4, 4), (2,), (Shard(0),), 16).record
    assert wanted_box(rec, None) == Chunk((0, 0), (4, 4))
    assert wanted_box(rec, ("F32", (4, 4), None)) is None
    with pytest.raises(
        LoadMismatchError, match="w: saved F32\\[4, 4\\] does not fit F32\\[4, 5\\]"
    ):
        wanted_box(rec, ("F32", (4, 5), ((0, 0), (2, 5))))
    with pytest.raises(LoadMismatchError, match="does not fit I64"):
        wanted_box(rec, ("I64", (4, 4), ((0, 0), (2, 4))))
    with pytest.raises(LoadMismatchError, match="outside"):
        wanted_box(rec, ("F32", (4, 4), ((3, 0), (2, 4))))


def test_the_spliced_merge_equals_the_decoded_one():
    mesh, placements = (4,), (Shard(0),)
    parts = []
    for rank, coord in enumerate(coordinates(mesh)):
        chunk = chunk_at((7, 3), mesh, coord, placements)
        writes = chunk.numel > 0
        entries = [
            dtable.RankEntry(n, "F32", (7, 3), ("Shard(dim=0)",), mesh, chunk if writes else None)
            for n in ("a", "b/c", 'q"uote')
        ]
        blocks = {n: [rank, 7] for n in ("a", "b/c", 'q"uote')}
        parts.append((fmt.shard_filename(rank), dtable.rank_json(entries, blocks)))
    spliced = dtable.merge(parts)
    assert spliced is not None
    decoded = dtable._merge_decoded([(s, t.split("\n")) for s, t in parts])
    assert json.loads(spliced) == json.loads(decoded)
    assert spliced == decoded
    # Ranks 0-3 hold 2, 2, 2, 1 rows: four chunks, none for an empty piece.
    assert [c["sizes"] for c in json.loads(spliced)["a"]["chunks"]] == [[2, 3]] * 3 + [[1, 3]]
    # A rank without DTensors takes the decoded path, with the same result for the others.
    assert json.loads(dtable.merge([*parts, ("shard_r00004.safetensors", "")])) == json.loads(
        decoded
    )
