"""Where each rank's piece of a DTensor lies, which rank saves it, and resharding on load.

Real DTensors live on a one-process gloo group (world size 1). Larger meshes are simulated:
``chunk_at`` runs torch's offset computation for any coordinate of any mesh shape, so one
process can lay out every rank of a 2×2 mesh and check that the pieces tile the tensor, that
exactly one rank saves each, and that any saved layout reassembles into any wanted one.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as distribute
from torch.distributed.tensor.placement_types import _StridedShard

from aiockpt._core.chunks import Chunk, byte_span, check_chunks, read_plan, scatter
from aiockpt._trainer import dist as _dist
from aiockpt._trainer.dtensor import (
    Held,
    check_placements,
    chunk_at,
    global_shape,
    is_writer,
    layout_facts,
    local_chunk,
    writes_at,
)
from aiockpt.errors import UnsupportedValueError


def layout(shape, mesh_shape, placements) -> dict[tuple[int, ...], Chunk]:
    """Every coordinate's chunk."""
    coords = itertools.product(*map(range, mesh_shape))
    return {c: chunk_at(shape, mesh_shape, c, placements) for c in coords}


def writers(shape, mesh_shape, placements) -> dict[tuple[int, ...], Chunk]:
    """The chunks of the coordinates that save theirs."""
    everyone = layout(shape, mesh_shape, placements)
    return {c: chunk for c, chunk in everyone.items() if writes_at(c, placements)}


# ---------------------------------------------------------------------------------------------
# Real DTensors on a one-rank group


@pytest.fixture(scope="module")
def world_of_one():
    """The default process group: gloo, one rank, this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mesh_shape", [(1,), (1, 1)])
@pytest.mark.parametrize("tensor_shape", [(5, 3), (7,), ()])
def test_a_real_dtensor_is_one_chunk_its_rank_writes(world_of_one, mesh_shape, tensor_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    full = torch.arange(math.prod(tensor_shape), dtype=torch.float32).reshape(tensor_shape)
    shard: list[Placement] = [Shard(0)] if tensor_shape else [Replicate()]
    for placements in ([Replicate()] * len(mesh_shape), (shard * 2)[: len(mesh_shape)]):
        dt = distribute(full, mesh, placements)
        assert global_shape(dt) == tensor_shape
        assert local_chunk(dt) == Chunk((0,) * len(tensor_shape), tensor_shape)
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        assert local_chunk(dt) == chunk_at(tensor_shape, mesh_shape, coordinate, placements)
        assert is_writer(dt)
        check_placements(dt, "model/w")


def test_a_partial_dtensor_is_refused_with_its_path(world_of_one):
    dt = DTensor.from_local(torch.ones(3), init_device_mesh("cpu", (1,)), [Partial()])
    with pytest.raises(UnsupportedValueError, match="^optim/m: .*Partial placement") as caught:
        check_placements(dt, "optim/m")
    assert caught.value.path == "optim/m"


def test_a_local_tensor_that_disagrees_with_its_placements_is_refused(world_of_one):
    mesh = init_device_mesh("cpu", (1,))
    dt = DTensor.from_local(
        torch.zeros(3, 3),
        mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size((5, 3)),
        stride=(3, 1),
    )
    with pytest.raises(UnsupportedValueError, match=r"local tensor has shape \[3, 3\]"):
        check_placements(dt, "w")


# ---------------------------------------------------------------------------------------------
# Simulated meshes: each rank's chunk and writer


def test_uneven_rows_split_as_torch_chunk_does():
    assert layout((5, 3), (2,), [Shard(0)]) == {
        (0,): Chunk((0, 0), (3, 3)),
        (1,): Chunk((3, 0), (2, 3)),
    }
    # One row on three ranks: the last two hold nothing (at the end of the dim).
    assert [c.sizes for c in layout((1, 2), (3,), [Shard(0)]).values()] == [
        (1, 2),
        (0, 2),
        (0, 2),
    ]
    check_chunks((1, 2), list(writers((1, 2), (3,), [Shard(0)]).values()), where="w")


def test_any_dim_shards_and_a_2d_mesh_shards_two_dims():
    assert layout((2, 5), (2,), [Shard(1)])[(1,)] == Chunk((0, 3), (2, 2))
    grid = layout((4, 6), (2, 2), [Shard(0), Shard(1)])
    assert grid[(1, 0)] == Chunk((2, 0), (2, 3))
    assert grid[(0, 1)] == Chunk((0, 3), (2, 3))
    # Both mesh dims on dim 0: the second splits what the first left.
    assert layout((8, 1), (2, 2), [Shard(0), Shard(0)])[(1, 0)] == Chunk((4, 0), (2, 1))


def test_the_first_rank_of_each_replica_group_writes():
    # HSDP: replicas along mesh dim 0, shards along mesh dim 1.
    hsdp = [Replicate(), Shard(0)]
    assert [c for c in itertools.product(range(2), range(2)) if writes_at(c, hsdp)] == [
        (0, 0),
        (0, 1),
    ]
    assert writes_at((0,), [Replicate()])
    assert not writes_at((3,), [Replicate()])
    assert writes_at((3,), [Shard(0)])


def test_fsdp_over_tp_evenly_gives_boxes_in_the_right_to_left_order():
    # torch's example: 8 rows, mesh (dp=2, tp=2); tp splits first, then dp each tp piece.
    fsdp_tp = [_StridedShard(0, split_factor=2), Shard(0)]
    rows = {c: (ch.offsets[0], ch.sizes[0]) for c, ch in layout((8, 8), (2, 2), fsdp_tp).items()}
    assert rows == {(0, 0): (0, 2), (0, 1): (4, 2), (1, 0): (2, 2), (1, 1): (6, 2)}


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "placements", "coordinate", "held"),
    [
        # torch's offset says rows 0..3; the rank holds rows 0, 1, 4, 5
        ((8, 2), (2,), [_StridedShard(0, split_factor=2)], (0,), "{0, 1, 4, 5}"),
        # FSDP over TP with 13 rows on (3, 2): the rank at (2, 0) holds rows 6 and 11
        ((13,), (3, 2), [_StridedShard(0, split_factor=2), Shard(0)], (2, 0), "{6, 11}"),
    ],
)
def test_a_strided_piece_that_is_not_one_box_is_refused(
    shape, mesh_shape, placements, coordinate, held
):
    with pytest.raises(ValueError, match="not one range") as caught:
        chunk_at(shape, mesh_shape, coordinate, placements)
    assert f"indices {held} of tensor dim 0" in str(caught.value)


# ---------------------------------------------------------------------------------------------
# Sub-meshes: copies of a mesh in the job's mesh

#: The dp sub-meshes of a (dp, tp) = 2 x 2 mesh: ranks {0, 2} and {1, 3}.
DP_OF_2X2 = ((0, 2), (1, 3))


def held(rank: int, shape=(5, 6), dtype=torch.float32, copies=DP_OF_2X2) -> Held:
    facts = layout_facts(shape, [Shard(0)], (2,), copies, rank)
    return Held("model/1.weight", cast(DTensor, SimpleNamespace(dtype=dtype)), facts)


def test_each_chunk_of_a_submesh_is_written_by_the_lowest_rank_of_its_copies():
    everyone = [held(rank) for rank in range(4)]
    assert [h.chunk for h in everyone] == [Chunk((0, 0), (3, 6)), Chunk((0, 0), (3, 6))] + [
        Chunk((3, 0), (2, 6))
    ] * 2
    assert [h.writes for h in everyone] == [True, False, True, False]
    assert {h.mesh_ranks for h in everyone} == {(0, 1, 2, 3)}
    # Copies listed in another order, or a tp sub-mesh ({0, 1} and {2, 3}): still the lowest.
    assert [held(r, copies=((1, 3), (0, 2))).writes for r in range(4)] == [True, False] * 2
    assert [held(r, copies=((0, 1), (2, 3))).writes for r in range(4)] == [True, True, False, False]
    # A Replicate sub-mesh: one writer among all four holders.
    rep = [layout_facts((5,), [Replicate()], (2,), DP_OF_2X2, r).writes for r in range(4)]
    assert rep == [True, False, False, False]
    # A rank in no copy holds nothing and writes nothing.
    outside = layout_facts((5, 6), [Shard(0)], (2,), DP_OF_2X2, 7)
    assert (outside.chunk, outside.writes) == (None, False)


def test_ranks_on_different_copies_of_a_submesh_agree_and_a_real_difference_is_shown():
    everyone = [held(rank) for rank in range(4)]
    assert len({_dist._signature([h]) for h in everyone}) == 1
    # Another global shape on rank 1: refused, the message showing both shapes.
    details = [_dist._details([held(r, shape=(4, 6) if r == 1 else (5, 6))]) for r in range(4)]
    with pytest.raises(UnsupportedValueError) as caught:
        _dist._refuse_disagreement(cast(Any, SimpleNamespace(ranks=(0, 1, 2, 3))), details)
    message = str(caught.value)
    assert message.startswith("model/1.weight: the ranks hold different DTensors here")
    assert "rank 0: torch.float32[5, 6]" in message
    assert "rank 1: torch.float32[4, 6]" in message
    # And another dtype.
    details = [
        _dist._details([held(r, dtype=torch.float64 if r else torch.float32)]) for r in range(4)
    ]
    with pytest.raises(UnsupportedValueError, match=r"rank 1: torch\.float64\[5, 6\]"):
        _dist._refuse_disagreement(cast(Any, SimpleNamespace(ranks=(0, 1, 2, 3))), details)


# ---------------------------------------------------------------------------------------------
# Properties over random layouts


MESH_SHAPES = [(1,), (2,), (3,), (4,), (1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (3, 1), (1, 4)]


@st.composite
def placements_for(draw, ndim: int, mesh_shape: tuple[int, ...]) -> list[Placement]:
    """Shard on any dim or Replicate per mesh dim; now and then FSDP over TP."""
    if ndim and len(mesh_shape) == 2 and draw(st.integers(0, 4)) == 0:
        d = draw(st.integers(0, ndim - 1))
        return [_StridedShard(d, split_factor=mesh_shape[1]), Shard(d)]
    choices = [Replicate(), *(Shard(d) for d in range(ndim))]
    return [draw(st.sampled_from(choices)) for _ in mesh_shape]


@st.composite
def layouts(draw, shape: tuple[int, ...]):
    """A mesh shape and placements of a tensor of ``shape`` whose pieces are boxes."""
    mesh_shape = draw(st.sampled_from(MESH_SHAPES))
    placements = draw(placements_for(len(shape), mesh_shape))
    try:
        layout(shape, mesh_shape, placements)
    except ValueError:  # an uneven strided shard: refused, as tested above
        placements = [Replicate()] * len(mesh_shape)
    return mesh_shape, placements


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_writers_chunks_tile_the_tensor_once_and_the_lowest_rank_writes(data):
    shape = data.draw(shapes)
    mesh_shape, placements = data.draw(layouts(shape))
    everyone = layout(shape, mesh_shape, placements)
    saved = writers(shape, mesh_shape, placements)
    check_chunks(shape, list(saved.values()), where="w")
    ranks = {c: i for i, c in enumerate(itertools.product(*map(range, mesh_shape)))}
    for coordinate, chunk in everyone.items():
        if chunk.numel == 0:
            continue
        holders = [ranks[c] for c, other in everyone.items() if other == chunk]
        written = [ranks[c] for c, other in saved.items() if other == chunk]
        assert written == [min(holders)]  # exactly one writer: the lowest rank holding it
        assert writes_at(coordinate, placements) == (ranks[coordinate] == min(holders))


def box_bytes(full: torch.Tensor, chunk: Chunk) -> bytes:
    """The row-major bytes of ``chunk`` of ``full``."""
    index = tuple(slice(o, o + s) for o, s in zip(*chunk, strict=True))
    return full[index].contiguous().numpy().tobytes()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_saved_layout_reassembles_into_any_wanted_layout(data):
    shape = data.draw(shapes)
    dtype = data.draw(st.sampled_from([torch.uint8, torch.int16, torch.float32, torch.float64]))
    full = (torch.arange(math.prod(shape)) % 251).to(dtype).reshape(shape)
    itemsize = full.element_size()
    saved = {
        chunk: box_bytes(full, chunk)
        for chunk in writers(shape, *data.draw(layouts(shape))).values()
    }
    for wanted in layout(shape, *data.draw(layouts(shape))).values():
        buffer = bytearray(wanted.numel * itemsize)
        copied = 0
        for chunk, stored in saved.items():
            runs = read_plan(chunk, wanted, itemsize)
            lo, hi = byte_span(runs)
            scatter(runs, stored[lo:hi], buffer, src_base=lo)  # one ranged read per chunk
            copied += sum(end - start for start, end, _ in runs)
        assert copied == len(buffer)  # each wanted byte came from exactly one saved chunk
        assert bytes(buffer) == box_bytes(full, wanted)
