"""Loads the trainer reads itself (see LoadReq.direct): when every byte a plan reads lies in a
local file, the daemon answers where (:func:`direct_plan`) and reads nothing; the trainer reads
the files straight into the tensors it returns and checks each tensor's crc32c."""

from __future__ import annotations

from typing import Any

from ..._core import format as fmt
from ..._core.protocol import DirectRead
from ...storage import CountingStorage
from ...storage._local import LocalStorage
from .plan import _Plan


def local_of(storage: Any, path: str) -> LocalStorage | None:
    """The local storage ``path`` is read from through ``storage`` (the counted root, a local
    tier's view), or None when it is not a plain local file (an object store, a peer's
    replica, a storage whose reads are its own)."""
    from ..tiers import TierView  # the tiers' module builds on this package's Reader

    while True:
        if isinstance(storage, CountingStorage):
            storage = storage.inner
        elif isinstance(storage, TierView):
            storage = storage._pick(path)  # the tier a read would take, and said as it does
        elif isinstance(storage, LocalStorage):
            # A subclass's own reads (a plugin's, a test's failing storage) are its to make.
            return storage if type(storage).readinto is LocalStorage.readinto else None
        else:
            return None


def direct_plan(storage: Any, plan: _Plan) -> DirectRead | None:
    """What the trainer reads for ``plan``: each piece of its plain ranges (the shard's own
    file or, for an incremental save, the files of other steps its blocks lie in) with where
    it goes in the load's output, and each tensor's crc32c; None when the plan has boxes (of
    distributed or borrowed tensors, assembled here) or some piece is not in a local file."""
    if plan.boxes:
        return None
    pieces: list[tuple[str, str, int, int, int]] = []
    crcs: dict[str, int] = {}
    files: dict[str, tuple[str, int | None]] = {}
    own = plan.smap.own
    for (lo, hi, items), base in zip(plan.ranges, plan.bases, strict=True):
        for e in plan.smap.pieces(lo, hi):
            local = local_of(storage, e.path)
            if local is None:
                return None
            pieces.append((local.root, e.path, e.offset, base + e.lo - lo, base + e.hi - lo))
            wrote = None if e.path == own else fmt.parse_step_dirname(e.path.partition("/")[0])
            files[e.path] = (plan.smap.where(e.path), wrote)
        for name, r in items:
            crcs[name] = r.crc32c
    return DirectRead(plan.where, tuple(pieces), crcs, files)
