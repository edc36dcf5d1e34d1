"""Shard layouts: where each tensor of a state lies in its shard file, and the header."""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..._core import format as fmt
from ..._core.gc import no_gc
from ..._core.protocol import DTensorEntry, LayoutMsg
from ..state import TORCH_TO_ST, Flat, StaleFlat

_layout_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each tensor of a state lies in its shard file, and the file's header."""

    id: int
    header: bytes
    #: (name, dtype, shape, start, end) in file order, offsets relative to the data section.
    specs: tuple[fmt.TensorSpec, ...]
    #: For each tensor in flatten order, its index in ``specs``.
    order: tuple[int, ...]
    #: Each tensor's shape and torch dtype, in flatten order: what a copy checks sources against.
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    #: The state's DTensors, as the daemon is told of them.
    dtensors: tuple[DTensorEntry, ...] = ()
    #: The sha256 of ``header``: a load whose shard has this head can read the shard into a
    #: slab of this layout as it lies in the file (LoadReq.image).
    digest: bytes = b""

    @property
    def data_start(self) -> int:
        """The data section's offset in the file: the header's length."""
        return len(self.header)

    @property
    def file_size(self) -> int:
        """The shard file's size in bytes."""
        return self.data_start + (self.specs[-1].end if self.specs else 0)

    @property
    def image(self) -> tuple[int, bytes]:
        """The header's length and sha256, as a load into a slab of this layout asks with
        (LoadReq.image)."""
        return self.data_start, self.digest

    def message(self) -> LayoutMsg:
        """The layout as the daemon is sent it."""
        return LayoutMsg(
            self.id,
            self.data_start,
            self.file_size,
            tuple((s.name, s.dtype, s.shape, s.start, s.end) for s in self.specs),
            self.dtensors,
        )


class LayoutCache:
    """Layouts by the state's shape, so a training loop computes its layout once."""

    def __init__(self, size: int = 8) -> None:
        self._cache: OrderedDict[tuple, Layout] = OrderedDict()
        self._size = size
        self._evicted: list[int] = []

    def get(self, flat: Flat) -> Layout:
        """The layout of ``flat``'s tensors, made on the first lookup of its key."""
        key = flat.key
        layout = self._cache.get(key)
        if layout is None:
            layout = self._cache[key] = make_layout(flat)
            if len(self._cache) > self._size:
                self._evicted.append(self._cache.popitem(last=False)[1].id)
        else:
            self._cache.move_to_end(key)
        return layout

    def take_evicted(self) -> list[int]:
        """Ids of layouts evicted since the last call: no later lookup returns them."""
        ids, self._evicted = self._evicted, []
        return ids


@no_gc  # 20k specs and a 2 MB JSON header: the collector tripled its time
def make_layout(flat: Flat) -> Layout:
    """The shard layout of ``flat``'s tensors as they are now.

    Raises StaleFlat when a tensor taken on trust (``flat.trusted`` False) turns out not to be
    savable: flatten afresh to have it refused with its key path.
    """
    tensors = flat.tensors
    dtypes = tuple(t.dtype for t in tensors)
    shapes = tuple(t.shape for t in tensors)
    if not flat.trusted and not all(
        d in TORCH_TO_ST and t.layout is torch.strided and (t.is_cpu or t.is_cuda)
        for d, t in zip(dtypes, tensors, strict=True)
    ):
        raise StaleFlat
    sizes = [t.element_size() for t in tensors]
    chunks = flat.chunk_names if flat.dtensors else frozenset()
    names = flat.names
    # Descending item size keeps every tensor naturally aligned with no padding (safetensors
    # allows no gaps); sorted() is stable, so equal sizes keep their tree order. DTensor
    # chunks come after the plain tensors, so that a load reads the plain ones in one range
    # and each chunk only where it needs it.
    file_order = sorted(range(len(tensors)), key=lambda i: (names[i] in chunks, -sizes[i]))
    specs = []
    pos = 0
    where = [0] * len(tensors)
    for i in file_order:
        if names[i] in chunks and pos % sizes[i]:
            # The first chunk after plain tensors of a smaller item size: a pad tensor keeps
            # it aligned (safetensors allows no gap), and no tree refers to it.
            pad = fmt.align_up(pos, sizes[i]) - pos
            specs.append(fmt.TensorSpec(fmt.PAD_NAME, "U8", (pad,), pos, pos + pad))
            pos += pad
        nbytes = math.prod(shapes[i]) * sizes[i]
        st_dtype = TORCH_TO_ST[dtypes[i]]
        where[i] = len(specs)
        specs.append(fmt.TensorSpec(names[i], st_dtype, tuple(shapes[i]), pos, pos + nbytes))
        pos += nbytes
    header = fmt.build_header(specs)
    entries = tuple(
        (
            h.name,
            TORCH_TO_ST[h.tensor.dtype],
            h.shape,
            h.placements,
            h.mesh,
            (h.chunk.offsets, h.chunk.sizes) if h.writes else None,
        )
        for h in flat.dtensors
    )
    digest = hashlib.sha256(header).digest()
    return Layout(
        next(_layout_ids), header, tuple(specs), tuple(where), shapes, dtypes, entries, digest
    )
