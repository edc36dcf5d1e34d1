"""Staging: shard layouts, the copy kernels, and the pool of shared-memory slabs the trainer
copies into.

A slab is one shared-memory segment holding a whole shard file: the safetensors header, then
every tensor, packed by descending item size so each stays naturally aligned and the data
section starts on a 4096-byte boundary. The daemon writes the slab as it is. Slabs are pooled:
fresh shared memory costs a page fault per page, a warm slab only the copy.

- layouts.py: :class:`Layout` (where each tensor lies in its file), :class:`LayoutCache`;
- copies.py: the copies into a slab (whole or a window at a time) and out of one;
- slabs.py: :class:`Slab`, :class:`SlabPool`.
"""

from __future__ import annotations

from .copies import (
    WindowCopy,
    copy_pairs,
    copy_window,
    sources_match,
    typed_views,
    window_copies,
)
from .layouts import Layout, LayoutCache, make_layout
from .slabs import Slab, SlabPool

__all__ = [
    "Layout",
    "LayoutCache",
    "Slab",
    "SlabPool",
    "WindowCopy",
    "copy_pairs",
    "copy_window",
    "make_layout",
    "sources_match",
    "typed_views",
    "window_copies",
]
