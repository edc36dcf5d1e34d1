"""The loaded bytes as tensors: a fresh segment mapped, views cut from it or from a slab,
RNG states given memory of their own."""

from __future__ import annotations

import _posixshmem
import math
import mmap
import os
from collections.abc import Iterator, Mapping

import torch

from ..._core import format as fmt
from ..._core.gc import no_gc
from ..._core.protocol import LoadReply, TensorAt
from ...errors import CorruptCheckpointError
from ..staging import Layout, typed_views
from ..state import ST_TO_TORCH


def map_loaded(
    reply: LoadReply, later: list[tuple[torch.Tensor, torch.Tensor]] | None = None
) -> dict[str, torch.Tensor]:
    """Map the daemon's load segment and view each tensor in it (no copy); ``later`` as in
    views (the daemon may still be reading into it)."""
    name, size = reply.segment, reply.size
    assert name is not None
    fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
    try:
        mm = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
        _posixshmem.shm_unlink(name)  # the mapping lives on as long as the tensors do
    u8 = torch.frombuffer(mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    return views(u8, reply.tensors, later)


class _Later(Mapping[str, torch.Tensor]):
    """The values a restore planned before the bytes are read hands over: a tensor of its own
    for each, paired in ``later`` with the view it is filled from once they are in."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], later: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self._tensors = tensors
        self._later = later

    def __getitem__(self, name: str) -> torch.Tensor:
        src = self._tensors[name]
        own = torch.empty_like(src)
        self._later.append((own, src))
        return own

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


@no_gc
def views(
    u8: torch.Tensor,
    specs: dict[str, TensorAt],
    later: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Each loaded tensor as a view of the bytes the daemon read.

    Tensors of one dtype that follow one another are cut from one typed view by a single
    split_with_sizes (see typed_views), which costs far less than a slice and two views per
    tensor. With
    ``later``, the bytes are not read yet: a tensor that gets memory of its own (see below)
    is left empty, paired there with the view it is to be filled from.
    """
    tensors: dict[str, torch.Tensor] = {}
    by_offset = sorted(specs.items(), key=lambda item: item[1][2])
    cuts = []
    for key, (dtype_name, shape, start) in by_offset:
        itemsize = fmt.DTYPE_SIZES[dtype_name]
        if start % itemsize:
            raise CorruptCheckpointError(f"tensor {key!r} is not aligned to its item size", key=key)
        cuts.append((ST_TO_TORCH[dtype_name], shape, start, math.prod(shape) * itemsize))
    for (name, (dtype_name, shape, _)), part in zip(by_offset, typed_views(u8, cuts), strict=True):
        if dtype_name == "U8" and len(shape) == 1 and part.numel() <= _RNG_STATE_BYTES:
            part = _own_memory(part, later)
        tensors[name] = part
    return tensors


@no_gc
def image_views(
    layout: Layout, own: list[torch.Tensor], later: list[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The tensors of a load read into a slab as the shard's file has them (LoadReply.image):
    ``own``, the slab's views of ``layout`` in flatten order, by name; what gets memory of
    its own is left empty and paired in ``later`` with its view, as in views."""
    specs = layout.specs
    tensors: dict[str, torch.Tensor] = {}
    for j, part in zip(layout.order, own, strict=True):
        spec = specs[j]
        if spec.dtype == "U8" and len(spec.shape) == 1 and part.numel() <= _RNG_STATE_BYTES:
            part = _own_memory(part, later)
        tensors[spec.name] = part
    return tensors


def _own_memory(
    part: torch.Tensor, later: list[tuple[torch.Tensor, torch.Tensor]] | None
) -> torch.Tensor:
    """``part``, an RNG state likely, in memory of its own: torch.set_rng_state and
    Generator.set_state read the tensor's storage from its start, whatever its offset. With
    ``later`` (the bytes not read yet) it is left empty, paired there with ``part``."""
    if later is None:
        return part.clone()
    own = torch.empty_like(part)
    later.append((own, part))
    return own


#: 1-D byte tensors up to this size come back owning their memory (see views): every torch
#: RNG state is one (the CPU generator's is 5056 bytes), and copying them costs nothing.
_RNG_STATE_BYTES = 64 * 1024
