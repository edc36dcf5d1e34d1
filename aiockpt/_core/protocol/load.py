"""The load requests and their reply (see the package's docstring): one :class:`ReadReq` per
load mode, each naming what it reads by a :class:`LoadAsk`, and :class:`LoadReply`; the
safetensors import's request and description.

This module imports nothing from aiockpt or outside the standard library.
"""

from __future__ import annotations

import dataclasses
import marshal
from dataclasses import dataclass, field
from typing import Any

from .common import Box, ReadReq, TensorAt, Wanted


@dataclass(frozen=True, slots=True)
class SlabRef:
    """A trainer's staging slab lent to a load."""

    name: str
    size: int


@dataclass(frozen=True, slots=True)
class LoadAsk:
    """What a load reads: ``rank``'s tensors of ``step`` (latest when None), read by a
    process of a ``world_size``-rank job."""

    step: int | None
    rank: int
    world_size: int
    #: Per distributed tensor restored into a DTensor, what that target wants; every other
    #: saved distributed tensor is read whole.
    wanted: dict[str, Wanted] | None = None
    #: Only the values at or under these key paths (None: all of them); with
    #: ``select_required``, a key path that names nothing is an error.
    select: tuple[str, ...] | None = None
    select_required: bool = True
    #: The key paths of the target restored into (its dicts walked): in a multi-rank
    #: checkpoint, those at which the rank saved nothing are read from the ranks that did (a
    #: full state saved by rank 0 alone, say). ``select``, when given, is asked instead.
    asked: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class LoadReq(ReadReq):
    """Read and verify what ``ask`` names into shared memory: into ``slab`` when it is large
    enough, else a new segment the trainer takes over (value: a :class:`LoadReply`)."""

    ask: LoadAsk
    slab: SlabRef | None = None
    #: A name for this load (``load.start``'s uuid): the reply says where each tensor will
    #: lie before a byte is read (``LoadReply.pending``) and the daemon reads them right
    #: after, so the trainer plans its restore meanwhile; a :class:`CollectReq` of the same
    #: name then answers once they are read and verified, or raises what failed.
    early: str | None = None
    #: The length and sha256 of the safetensors header of the layout ``slab`` holds for the
    #: state restored into: when the shard's head is that header and the load reads every
    #: tensor of the shard, answered early, the daemon reads the tensors into the slab
    #: where the file has them, so that they lie where the slab's views of that layout
    #: are, and says so (``LoadReply.image``) instead of where each tensor lies.
    image: tuple[int, bytes] | None = None
    #: The trainer reads the bytes itself when they all lie in local files: the reply then
    #: says which (``LoadReply.direct``) and nothing is read, nor any segment made, here.
    direct: bool = False


@dataclass(frozen=True, slots=True)
class DirectRead:
    """A load the trainer reads itself from local files (see LoadReq.direct): ``pieces``,
    (root, path under it, offset in the file, start, end in the load's output), in output
    order; the crc32c each tensor's bytes must have; ``where``, the shard's URL, and per
    path read, its URL and, when another step's file holds some of the shard's blocks, that
    step: for messages."""

    where: str
    pieces: tuple[tuple[str, str, int, int, int], ...]
    crcs: dict[str, int]
    files: dict[str, tuple[str, int | None]]


@dataclass(frozen=True, slots=True)
class CappedLoadReq(ReadReq):
    """A load through ``slab`` in windows of at most ``window`` bytes (``staging_memory``):
    every window read and checked, the reply saying where each tensor lies in the whole
    load and what the windows are; with ``early``, it comes first (see LoadReq.early)."""

    ask: LoadAsk
    slab: SlabRef
    window: int
    early: str | None = None


@dataclass(frozen=True, slots=True)
class CappedWindowReq(ReadReq):
    """Window ``part`` of the :class:`CappedLoadReq` of ``ask`` and ``window``, read into
    ``slab`` from its start (the reply's ``tensors`` and ``tree`` are empty)."""

    ask: LoadAsk
    slab: SlabRef
    window: int
    part: int


@dataclass(frozen=True, slots=True)
class StreamReq(ReadReq):
    """Start streamed load ``name`` (``load(into=..., atomic=False)``), in windows of at most
    ``window`` bytes: nothing is read, the reply says where each tensor lies and what the
    windows are, each then asked for in order by a :class:`StreamWindowReq`."""

    ask: LoadAsk
    window: int
    name: str


@dataclass(frozen=True, slots=True)
class StreamWindowReq(ReadReq):
    """Window ``part`` of streamed load ``name``, read into ``slab`` from its start and
    checked as it is read (a tensor cut by windows once its last is in)."""

    name: str
    slab: SlabRef
    part: int


@dataclass(frozen=True, slots=True)
class CollectReq(ReadReq):
    """The end of load ``name``, answered early: once its bytes are read and verified (the
    reply's ``tensors`` and ``tree`` empty), or what failed."""

    name: str


@dataclass(frozen=True, slots=True)
class LoadReply:
    """Where a load's verified bytes are, and what the checkpoint says of them."""

    step: int
    #: The new segment to map, or None when the bytes are in the lent slab.
    segment: str | None
    size: int
    tensors: dict[str, TensorAt]
    tree: Any
    metrics: dict[str, Any]
    metadata: dict[str, Any]
    created_at: float
    nbytes: int
    url: str
    #: Bytes this load read from storage (plain tensors and the chunks of distributed ones).
    read_nbytes: int = 0
    #: Key paths a selection left out of ``tree`` (see LoadAsk.select).
    left_out: tuple[str, ...] = ()
    #: A load in windows: each window's byte range of the whole load.
    windows: tuple[tuple[int, int], ...] = ()
    #: Answered early (see LoadReq.early): the bytes are still to be read.
    pending: bool = False
    #: The tensors lie in the lent slab where the shard's file has them, as the layout of
    #: ``LoadReq.image`` places them; ``tensors`` is then empty.
    image: bool = False
    #: Nothing was read: the trainer reads the bytes from these local files (LoadReq.direct).
    direct: DirectRead | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled with ``tensors`` and ``tree`` as one marshal blob: plain tuples, lists,
        dicts and scalars that marshal writes and reads in a fraction of pickle's time, on
        the critical path of every load.
        Both ends run the same interpreter (the daemon is spawned with it), which marshal
        needs."""
        rest = tuple(getattr(self, f.name) for f in _REPLY_REST)
        return _load_reply, (marshal.dumps((self.tensors, self.tree)), rest)


#: The fields of LoadReply pickled as usual (see LoadReply.__reduce__).
_REPLY_REST = tuple(f for f in dataclasses.fields(LoadReply) if f.name not in ("tensors", "tree"))


def _load_reply(blob: bytes, rest: tuple[Any, ...]) -> LoadReply:
    tensors, tree = marshal.loads(blob)
    fields = {f.name: v for f, v in zip(_REPLY_REST, rest, strict=True)}
    return LoadReply(tensors=tensors, tree=tree, **fields)


@dataclass(frozen=True, slots=True)
class SafetensorsReq(ReadReq):
    """A Hugging Face safetensors ``source`` (a .safetensors file, or a folder holding
    ``model.safetensors`` or ``model.safetensors.index.json`` and its shards; a path or URL
    opened with ``storage_options``), its headers checked as untrusted input. With ``read``
    None, value: a :class:`SafetensorsInfo`. With ``read``, each (name, file, dtype, shape,
    start, box) read into a new segment the trainer takes over, the whole tensor (box None)
    or the box of it (see chunks.read_plan): value a :class:`LoadReply` (``step`` 0) saying
    where each name lies."""

    source: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    read: tuple[tuple[str, str, str, tuple[int, ...], int, Box | None], ...] | None = None


@dataclass(frozen=True, slots=True)
class SafetensorsInfo:
    """What a safetensors source holds: per tensor name (file, dtype, shape, start, end),
    offsets absolute in the file; the metadata of its index or single file's header; and
    the source's URL."""

    url: str
    tensors: dict[str, tuple[str, str, tuple[int, ...], int, int]]
    metadata: dict[str, Any]
