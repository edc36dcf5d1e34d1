"""A file's bytes as a sequence of pieces made when a storage asks for each.

``Storage.write_file`` takes the pieces of a file as a sequence of buffers. A deduplicated
shard (only some blocks written, some decided while the write runs) and a copied one (read
and checked as it streams) make their pieces on demand; this base class is the sequence
protocol around that.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload


class Pieces(Sequence[memoryview]):
    """The pieces of one file; subclasses say how many (``__len__``) and make each
    (``piece``), in any order a storage asks, as often as it asks."""

    def piece(self, i: int) -> memoryview:
        """Piece ``i`` (0 <= i < len(self))."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> memoryview: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[memoryview]: ...
    def __getitem__(self, i: int | slice) -> Any:
        n = len(self)
        if isinstance(i, slice):
            return [self.piece(k) for k in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self.piece(i)

    def __iter__(self) -> Iterator[memoryview]:
        for i in range(len(self)):
            yield self.piece(i)
