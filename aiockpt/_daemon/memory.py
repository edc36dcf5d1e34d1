"""What the writer keeps of the last save written from each slab, for ``skip_unchanged``.

With ``skip_unchanged=True`` the trainer leaves in its slab the tensors that did not change
since the slab's last copy and names them in the next :class:`SaveReq` (``unchanged``). Their
bytes are then the bytes that save wrote, so the writer takes their crc32c, and the hash and
crc32c of every block lying wholly in them, from what it kept of that save instead of reading
them. It does so only when that save is the slab's copy just before this one (``copy_gen``)
with the same layout; anything else (a save that failed, a daemon started since, a slab a
load wrote over) and the bytes are read, as without the option.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .._core import blocks as bl
from .._core import format as fmt
from .._core.protocol import LayoutMsg, SaveReq


@dataclass(frozen=True, slots=True)
class Remembered:
    """One save written from a slab: its copy's number, its layout, the crc32c of each tensor
    (in the layout's tensor order, padding left out) and the hash and crc32c of each block
    (none without deduplication)."""

    gen: int
    layout_id: int
    tensor_crcs: list[int]
    block_sums: list[tuple[str, int]]


class SlabMemory:
    """The :class:`Remembered` save of each slab, by name (the writer thread's own)."""

    def __init__(self) -> None:
        self._by_slab: dict[str, Remembered] = {}

    def recall(
        self, req: SaveReq, msg: LayoutMsg, tensor_index: dict[int, int]
    ) -> tuple[dict[int, int], dict[tuple[int, int], tuple[str, int]]]:
        """What save ``req`` may take from the slab's last one: the crc32c of each tensor it
        left as it was (by its index among the layout's tensors; ``tensor_index`` maps an
        index of ``msg.specs`` to it), and the hash and crc32c of each block lying wholly in
        such tensors or padding, by the block's span. What was kept is used once."""
        mem = self._by_slab.pop(req.slab, None)
        if (
            not req.unchanged
            or mem is None
            or (mem.gen, mem.layout_id) != (req.copy_gen - 1, req.layout_id)
        ):
            return {}, {}
        tensors = {
            tensor_index[j]: mem.tensor_crcs[tensor_index[j]]
            for j in req.unchanged
            if j in tensor_index
        }
        if not mem.block_sums:
            return tensors, {}
        start, specs = msg.data_start, msg.specs
        same = set(req.unchanged) | {j for j, s in enumerate(specs) if s[0] == fmt.PAD_NAME}
        runs: list[list[int]] = []  # the bytes left as they were, merged
        for j, s in enumerate(specs):
            if j in same:
                if runs and runs[-1][1] == start + s[3]:
                    runs[-1][1] = start + s[4]
                else:
                    runs.append([start + s[3], start + s[4]])
        spans = sorted((start + s[3], start + s[4]) for s in specs)
        lows = [lo for lo, _ in runs]
        blocks: dict[tuple[int, int], tuple[str, int]] = {}
        for i, (a, b) in enumerate(bl.cut_blocks(spans, start, msg.file_size)):
            r = bisect.bisect_right(lows, a) - 1
            if r >= 0 and runs[r][1] >= b:
                blocks[(a, b)] = mem.block_sums[i]
        return tensors, blocks

    def keep(self, req: SaveReq, tensor_crcs: list[int], sums: list[tuple[str, int]]) -> None:
        """Keep the sums of save ``req``, written whole from its slab."""
        if req.copy_gen:
            self._by_slab[req.slab] = Remembered(req.copy_gen, req.layout_id, tensor_crcs, sums)

    def forget(self, names: tuple[str, ...]) -> None:
        """Slabs the trainer destroyed."""
        for name in names:
            self._by_slab.pop(name, None)
