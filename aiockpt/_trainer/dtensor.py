"""Where a rank's piece of a DTensor lies in the global tensor, and whether this rank saves it.

A DTensor's placements say, per mesh dim, how the global tensor is split over that mesh dim:
``Shard(d)`` chunks tensor dim ``d`` the way ``torch.chunk`` does (5 rows on 2 ranks are
3 + 2; later ranks may get nothing), ``Replicate()`` gives every rank along it the same data,
``Partial()`` holds addends of a sum that nobody has reduced yet. torch computes a rank's
piece as a shape and a global offset (``compute_local_shape_and_global_offset``, the function
distributed checkpointing relies on); this module turns that into a :class:`Chunk`.

``_StridedShard`` (FSDP2 over tensor parallel: placements ``(_StridedShard(0, sf=tp),
Shard(0))`` on a ``(dp, tp)`` mesh) is where that offset can mislead. torch tracks, per
sharded dim, the list of global indices a rank holds and reports only the first of them.
After the ``Shard`` that follows it, the list is one run of consecutive indices when the
sizes divide evenly, and the piece is a box. Otherwise it need not be: 13 rows on a (3, 2)
mesh give the rank at (2, 0) rows {6, 11}; and a ``_StridedShard`` with no matching
``Shard`` after it leaves every rank ``split_factor`` blocks spaced apart (8 rows,
``(_StridedShard(0, sf=2),)`` on 2 ranks: rank 0 holds rows {0, 1, 4, 5}, while torch's
shape and offset describe rows 0..3). Such a piece is no box, so :func:`chunk_at` computes
the full index list on the strided dims and refuses what is not one run.

A DTensor's mesh may be a sub-mesh of the job's mesh: on a ``(dp, tp)`` mesh, a module left
out of tensor parallelism and sharded by FSDP over ``mesh["dp"]`` has DTensors of the dp
sub-mesh, of which there is one copy per tp rank, all holding the same value. Each chunk is
saved by one copy only (:func:`layout_facts`), and the ranks agree on the ranks of all the
copies, not on which copy each one is in.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)
from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

from .._core.chunks import Chunk
from ..errors import UnsupportedValueError

__all__ = [
    "Held",
    "check_placements",
    "chunk_at",
    "describe",
    "global_shape",
    "is_writer",
    "layout_facts",
    "local_chunk",
    "writes_at",
]


def global_shape(dt: DTensor) -> tuple[int, ...]:
    """The shape of the whole tensor that ``dt`` is a piece of."""
    return tuple(int(n) for n in dt.shape)


def chunk_at(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> Chunk:
    """The chunk held at ``coordinate`` of a mesh of ``mesh_shape``, for a tensor of global
    ``shape`` placed by ``placements``; needs no process group, so one process can compute
    every rank's chunk.

    This is torch's own computation (what ``compute_local_shape_and_global_offset`` runs for
    the current rank). Raises ValueError when a ``_StridedShard`` leaves the piece in more
    than one box (see the module's docstring).
    """
    sizes, offsets = _compute_local_shape_and_global_offset(
        tuple(shape), tuple(mesh_shape), list(coordinate), placements
    )
    chunk = _as_chunk(sizes, offsets)
    _check_strided_box(chunk, tuple(shape), mesh_shape, coordinate, placements)
    return chunk


def local_chunk(dt: DTensor) -> Chunk:
    """The chunk of the global tensor that this rank's local tensor of ``dt`` holds.

    Raises ValueError on a rank outside ``dt``'s mesh (it holds nothing; :func:`is_writer`
    is False there) and where a ``_StridedShard`` piece is not one box.
    """
    mesh = dt.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not in the DTensor's device mesh and holds none of it")
    sizes, offsets = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
    chunk = _as_chunk(sizes, offsets)
    _check_strided_box(chunk, global_shape(dt), mesh.shape, coordinate, dt.placements)
    return chunk


def writes_at(coordinate: Sequence[int], placements: Sequence[Placement]) -> bool:
    """Whether the rank at ``coordinate`` is the one that saves its chunk.

    The chunk a rank holds depends only on its coordinates along the sharded mesh dims, and
    along them distinct coordinates hold disjoint (or empty) chunks: so the ranks holding one
    same chunk are those that differ only along the ``Replicate`` mesh dims. Exactly one of
    them has coordinate 0 on all of those dims. In a mesh laid out the way
    ``init_device_mesh`` lays it out (global ranks in row-major order of the coordinates), a
    rank is a sum of its coordinates times positive strides, so that one is also the lowest
    global rank among them. (A DeviceMesh built from a rank tensor in another order still gets
    exactly one writer per chunk, just not always the lowest rank.)
    """
    return all(
        c == 0 for c, p in zip(coordinate, placements, strict=True) if isinstance(p, Replicate)
    )


def is_writer(dt: DTensor) -> bool:
    """Whether this rank saves its chunk of ``dt``: exactly one rank of those holding an
    identical chunk does (see :func:`writes_at` and :func:`layout_facts`); False on a rank
    outside the mesh."""
    mesh = dt.device_mesh
    copies, rank = _copies(mesh), int(mesh.get_rank())
    mesh_shape = tuple(int(n) for n in mesh.shape)
    coordinate = _coordinate_of(rank, mesh_shape, copies)
    return coordinate is not None and _writes(rank, coordinate, dt.placements, mesh_shape, copies)


def check_placements(dt: DTensor, path: str) -> Chunk | None:
    """Refuse, with :class:`~aiockpt.errors.UnsupportedValueError` naming ``path``, a DTensor
    whose local piece cannot be saved as one chunk of the global tensor: a ``Partial``
    placement (its pieces are addends of a sum not yet reduced, not parts of the tensor), a
    placement type this module does not know, a ``_StridedShard`` piece that is not one box,
    or a local tensor whose shape is not the one its placements give. Returns this rank's
    chunk, None on a rank outside the mesh.
    """
    return _facts(dt, path).chunk


@dataclass(frozen=True, slots=True)
class _Facts:
    """What a DTensor's mesh, placements and global shape decide for this rank."""

    #: The global shape, and the placements and mesh shape (as text, for the manifest).
    shape: tuple[int, ...]
    placements: tuple[str, ...]
    mesh: tuple[int, ...]
    #: The global ranks of the mesh and of every copy of it in the job's mesh (a dp
    #: sub-mesh's copies along tp), sorted: the ranks that hold the DTensor.
    mesh_ranks: tuple[int, ...]
    #: This rank's chunk; None on a rank outside the mesh.
    chunk: Chunk | None
    #: Whether this rank writes its chunk: it is the one writer of it (see writes_at), and
    #: the chunk holds something.
    writes: bool


@dataclass(frozen=True, slots=True)
class Held:
    """A DTensor of a state, as this rank saves it or loads into it."""

    name: str
    tensor: DTensor
    facts: _Facts

    shape = property(lambda self: self.facts.shape, doc="The global shape.")
    placements = property(lambda self: self.facts.placements, doc="Placements, as text.")
    mesh = property(lambda self: self.facts.mesh, doc="The mesh's shape.")
    mesh_ranks = property(
        lambda self: self.facts.mesh_ranks, doc="The global ranks of the mesh and its copies."
    )
    chunk = property(lambda self: self.facts.chunk, doc="This rank's chunk, None outside.")
    writes = property(lambda self: self.facts.writes, doc="Whether this rank writes it.")

    @property
    def key(self) -> tuple:
        """What decides the shard layout and the manifest entry."""
        f = self.facts
        return (f.shape, f.placements, f.mesh, f.chunk, f.writes)


def describe(dt: DTensor, path: str) -> Held:
    """What this rank saves of ``dt``, found at key path ``path``; refuses (with
    :class:`~aiockpt.errors.UnsupportedValueError` naming ``path``) what check_placements
    refuses."""
    return Held(path, dt, _facts(dt, path))


def _facts(dt: DTensor, path: str) -> _Facts:
    # A state of thousands of DTensors shares a few layouts: what they decide is cached.
    try:
        facts = _facts_of(dt.device_mesh, tuple(dt.placements), tuple(dt.shape))
    except _Refused as e:
        raise UnsupportedValueError(path, str(e)) from None
    chunk = facts.chunk
    if chunk is not None:
        local = tuple(dt._local_tensor.shape)
        if local != chunk.sizes:
            raise UnsupportedValueError(
                path,
                f"the DTensor's local tensor has shape {list(local)}, but its placements "
                f"{list(dt.placements)} give this rank a piece of shape {list(chunk.sizes)}",
            )
    return facts


class _Refused(ValueError):
    """A layout that cannot be saved (the message says why)."""


@functools.lru_cache(maxsize=4096)
def _facts_of(mesh: object, placements: tuple[Placement, ...], shape: tuple[int, ...]) -> _Facts:
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Partial):
            raise _Refused(
                f"a DTensor with a Partial placement on mesh dim {mesh_dim} holds unreduced "
                "addends, not a piece of the tensor; redistribute it to Replicate() or "
                "Shard() before saving"
            )
        if not isinstance(placement, (Shard, _StridedShard, Replicate)):
            raise _Refused(
                f"a DTensor placement {placement!r} on mesh dim {mesh_dim} is not supported"
            )
    mesh_shape = tuple(int(n) for n in mesh.shape)  # type: ignore[attr-defined]
    rank = int(mesh.get_rank())  # type: ignore[attr-defined]
    return layout_facts(shape, placements, mesh_shape, _copies(mesh), rank)


def layout_facts(
    shape: tuple[int, ...],
    placements: Sequence[Placement],
    mesh_shape: tuple[int, ...],
    copies: Sequence[Sequence[int]],
    rank: int,
) -> _Facts:
    """What a DTensor of global ``shape`` placed by ``placements`` on a mesh of
    ``mesh_shape`` decides for global rank ``rank``; needs no process group.

    ``copies`` holds the global ranks of every copy of the mesh in the job's mesh, each in
    row-major order of its coordinates: one copy for a mesh that is the job's own, one per
    tp rank for the dp sub-mesh of a ``(dp, tp)`` mesh (``[[0, 2], [1, 3]]`` on 2 × 2). Every
    copy holds the same value, so a chunk is written by one copy only: at each coordinate, by
    the lowest global rank of the copies (with :func:`writes_at` choosing the coordinate).
    The ranks agree on the facts of :attr:`_Facts.mesh_ranks`, the ranks of all the copies,
    not on which copy each one is in.
    """
    chunk, writes = None, False
    coordinate = _coordinate_of(rank, mesh_shape, copies)
    if coordinate is not None:
        try:
            chunk = chunk_at(shape, mesh_shape, coordinate, placements)
        except ValueError as e:
            raise _Refused(str(e)) from None
        writes = chunk.numel > 0 and _writes(rank, coordinate, placements, mesh_shape, copies)
    ranks = tuple(sorted({int(r) for copy in copies for r in copy}))
    return _Facts(shape, tuple(map(repr, placements)), mesh_shape, ranks, chunk, writes)


def _copies(mesh: object) -> tuple[tuple[int, ...], ...]:
    """The global ranks of every copy of ``mesh`` in the job's mesh (see layout_facts)."""
    layout = getattr(mesh, "_layout", None)
    rank_map = getattr(mesh, "_rank_map", None)
    if layout is not None and rank_map is not None:
        copies = layout.remap_to_tensor(rank_map).flatten(start_dim=1)
    else:  # a torch whose meshes keep no layout: the mesh alone
        copies = mesh.mesh.flatten().unsqueeze(0)  # type: ignore[attr-defined]
    return tuple(tuple(int(r) for r in copy) for copy in copies.tolist())


def _coordinate_of(
    rank: int, mesh_shape: tuple[int, ...], copies: Sequence[Sequence[int]]
) -> tuple[int, ...] | None:
    """Where ``rank`` is in the copy of the mesh holding it; None when no copy does."""
    for copy in copies:
        if rank in copy:
            index, coordinate = list(copy).index(rank), []
            for n in reversed(mesh_shape):
                index, c = divmod(index, n)
                coordinate.append(c)
            return tuple(reversed(coordinate))
    return None


def _writes(
    rank: int,
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    copies: Sequence[Sequence[int]],
) -> bool:
    """Whether ``rank``, at ``coordinate`` of its copy of the mesh, writes its chunk: the
    coordinate is the writing one of its copy (writes_at), and of the copies' ranks at that
    coordinate, ``rank`` is the lowest."""
    if not writes_at(coordinate, placements):
        return False
    index = 0
    for c, n in zip(coordinate, mesh_shape, strict=True):
        index = index * n + c
    return rank == min(int(copy[index]) for copy in copies)


def _as_chunk(sizes: Sequence[int], offsets: Sequence[int]) -> Chunk:
    return Chunk(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))


def _check_strided_box(
    chunk: Chunk,
    shape: tuple[int, ...],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> None:
    """Raise ValueError unless, on every dim a ``_StridedShard`` splits, the global indices
    this coordinate holds are the consecutive run that ``chunk`` claims."""
    strided_dims = sorted({p.dim for p in placements if isinstance(p, _StridedShard)})
    for dim in strided_dims:
        held = _held_indices(shape[dim], dim, mesh_shape, coordinate, placements)
        claimed = range(chunk.offsets[dim], chunk.offsets[dim] + chunk.sizes[dim])
        if held and held != list(claimed):
            raise ValueError(
                f"placements {list(placements)} give mesh coordinate {list(coordinate)} the "
                f"indices {_brief(held)} of tensor dim {dim}, which are not one range: a "
                "strided shard (FSDP over tensor parallel with sizes that do not divide "
                "evenly) that does not form one box of the tensor"
            )


def _held_indices(
    size: int,
    dim: int,
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> list[int]:
    """The global indices of tensor dim ``dim`` held at ``coordinate``, in local order.

    The placements split the dim left to right, each splitting what the one before left; this
    follows torch's own per-placement split (``local_shard_size_and_offset``) down to the
    list of indices, which torch's offset computation keeps too but reports only the first of.
    """
    held = list(range(size))
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, (Shard, _StridedShard)) or p.dim != dim:
            continue
        n, rank = int(mesh_shape[mesh_dim]), int(coordinate[mesh_dim])
        if isinstance(p, _StridedShard):
            _, picked = p.local_shard_size_and_offset(
                len(held), n, rank, _StridedShardOffsetMode.ALL
            )
            held = [held[i] for i in picked] if isinstance(picked, list) else []
        else:
            count, start = Shard.local_shard_size_and_offset(len(held), n, rank)
            held = held[int(start) : int(start) + int(count)]
    return held


def _brief(indices: list[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:8])
    return "{" + shown + (", …}" if len(indices) > 8 else "}")
