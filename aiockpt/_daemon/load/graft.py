"""One global namespace of keys: what a rank's load asks for and the rank did not save is
read from the ranks that did.

A multi-rank checkpoint holds one tree per rank. A rank's load starts from its own tree (on
another world size, rank 0's); each key path the load asks for (its ``keys``, or the key
paths of the target it restores into) at which that tree holds nothing is taken from the
other ranks' trees: a full state dict saved by rank 0 alone, say, loads on every rank. The
ranks that saved something there must have saved the same thing (the same tree, every
tensor the same dtype, shape and crc32c); when they differ, a rank that saved nothing there
cannot tell which it wants, and its load is refused naming the key and the ranks.

The tensors taken so are read from their rank's shard as one chunk each, the whole tensor,
through the :class:`~aiockpt._core.reshard.Assembler` (which checks each against its crc32c):
:class:`Borrowed` describes one the way a distributed tensor's record does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..._core import format as fmt
from ..._core.chunks import Chunk
from ..._core.dtable import ChunkRecord
from ..._core.tree import DICT, STATEFUL, select_paths, tensor_references
from ...errors import CorruptCheckpointError, LoadMismatchError


class Borrowed:
    """A plain tensor of another rank's shard, read whole: as the assembler reads a
    distributed tensor of one chunk."""

    __slots__ = ("_chunks", "dtype", "name", "shape")

    def __init__(self, name: str, rec: fmt.TensorRecord) -> None:
        self.name = name
        self.dtype = rec.dtype
        self.shape = rec.shape
        whole = Chunk((0,) * len(rec.shape), rec.shape)
        chunk = ChunkRecord(whole, rec.shard, rec.start, rec.end, rec.crc32c, ())
        self._chunks = [chunk] if rec.end > rec.start else []

    @property
    def box(self) -> Chunk:
        """The box a load of it reads: all of it."""
        return Chunk((0,) * len(self.shape), self.shape)

    def covering(self, box: Chunk) -> list[ChunkRecord]:
        """The chunks that meet ``box``: the one chunk (none when the tensor is empty)."""
        return self._chunks


def graft(
    m: fmt.Manifest, rank: int, tree: Any, asked: Iterable[str]
) -> tuple[Any, dict[str, Borrowed]]:
    """``tree`` (``rank``'s tree of ``m``) with what the other ranks saved at each key path
    of ``asked`` where it holds nothing, and the tensors of theirs it now refers to."""
    _, missing = select_paths(tree, tuple(asked))
    borrowed: dict[str, Borrowed] = {}
    for path in sorted(missing):
        donors = [
            (r, cut)
            for r in sorted(m.trees)
            if r != rank and path not in (cut := select_paths(m.trees[r], (path,)))[1]
        ]
        if not donors:
            continue  # nobody saved it: the load says so as it would have
        first, cut = donors[0]
        _agree(m, path, rank, first, cut[0], donors[1:])
        merged = _merge(tree, cut[0])
        if merged is not None:
            tree = merged
            for name in sorted(tensor_references(cut[0])[0]):
                borrowed[name] = Borrowed(name, _record(m, first, name))
    return tree, borrowed


def _agree(m: fmt.Manifest, path: str, rank: int, first: int, cut: Any, others: list) -> None:
    """Raise when the ranks that saved something at ``path`` did not all save the same."""
    text = json.dumps(cut, sort_keys=True)
    names = tensor_references(cut)[0]
    differ = [
        r
        for r, (other, _) in others
        if json.dumps(other, sort_keys=True) != text
        or any(_same(_record(m, r, n)) != _same(_record(m, first, n)) for n in names)
    ]
    if differ:
        saved = ", ".join(map(str, [first, *(r for r, _ in others)]))
        raise LoadMismatchError(
            f"{path!r}: rank {rank} saved nothing there and asks for it, but the ranks that "
            f"saved it (ranks {saved}) saved different values (ranks "
            f"{', '.join(map(str, differ))} differ from rank {first}): load it on the ranks "
            "that saved it, or save one value for every rank"
        )


def _same(rec: fmt.TensorRecord) -> tuple[str, tuple[int, ...], int]:
    return rec.dtype, rec.shape, rec.crc32c


def _record(m: fmt.Manifest, rank: int, name: str) -> fmt.TensorRecord:
    shard = m.shard_of(rank)
    try:
        return m.tensors[shard.file][name]
    except KeyError:
        where = f"{fmt.step_dirname(m.step)}/manifest.json"
        raise CorruptCheckpointError(
            f"{where}: rank {rank}'s tree refers to a tensor {name!r} its shard does not hold",
            path=where,
        ) from None


def _merge(into: Any, cut: Any) -> Any:
    """``into`` with what ``cut`` (a tree cut down to one key path, with the dicts that lead
    there) holds where ``into`` holds nothing, as a new tree sharing ``into``'s untouched
    nodes (a manifest's trees are kept and reused); None when their shapes differ on the way
    (a dict in one, another value in the other): then the restore names the difference as
    it would have."""
    ((tag, body),) = into.items()
    ((ctag, cbody),) = cut.items()
    if tag != ctag or tag not in (DICT, STATEFUL):
        return None
    if tag == STATEFUL:
        inner = _merge(body, cbody)
        return None if inner is None else {STATEFUL: inner}
    if len(cbody) != 1:
        return None
    ((key, child),) = cbody
    for i, (k, mine) in enumerate(body):
        if k == key:
            merged = _merge(mine, child)
            if merged is None:
                return None
            return {DICT: [*body[:i], [key, merged], *body[i + 1 :]]}
    return {DICT: [*body, [key, child]]}
