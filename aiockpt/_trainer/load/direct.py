"""A load read by the training process itself (see LoadReq.direct): the daemon says which
local files hold each tensor's bytes, and they are read straight into the tensors the load
returns, on a few threads (``os.preadv`` releases the GIL), each piece's crc32c taken by the
thread that read it while the bytes are in its cache. No shared memory, no copy.

The files are opened as the daemon's storage opens them (``LocalStorage._open_regular``:
regular files only, never through a symbolic link under the root) and read, never mapped: a
file cut short under the load is a :class:`StorageError` naming it, not a SIGBUS."""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Iterator

import crc32c
import torch

from ..._core import format as fmt
from ..._core.protocol import DirectRead, LoadReply, TensorAt
from ..._crc import combine
from ...errors import CorruptCheckpointError, StorageError
from ...storage._local import LocalStorage, _read_all
from .views import views

#: A tensor of at least this many bytes gets memory of its own; smaller ones lying back to
#: back share a buffer of up to GROUP_BYTES, read as one (a request and an allocation per
#: small tensor cost more than their bytes).
OWN_MIN = 1 << 20
GROUP_BYTES = 16 << 20
#: The most bytes one read request takes; READERS requests are in flight at once.
PIECE = 8 << 20
READERS = 4
#: Buffers start at this alignment of the load's output, so each tensor keeps its own.
_ALIGN = 64

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_STARTING = threading.Lock()

#: One read: (file index, offset in the file, group, start in the group, length).
Job = tuple[int, int, int, int, int]


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _STARTING:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(
                READERS, thread_name_prefix="aiockpt-direct-read"
            )
        return _POOL


def _groups(specs: dict[str, TensorAt]) -> list[tuple[int, int, list[str]]]:
    """The buffers a load's tensors are read into: (start, end in the load's output, names),
    a large tensor alone (its buffer is its storage, no more), small ones lying back to back
    together (from an aligned start, so each keeps its alignment)."""
    out: list[tuple[int, int, list[str]]] = []
    small = False
    for name, spec in sorted(specs.items(), key=lambda kv: kv[1][2]):
        start, n = spec[2], _nbytes(spec)
        lone = n >= OWN_MIN
        if lone and start % fmt.DTYPE_SIZES[spec[0]]:
            raise CorruptCheckpointError(
                f"tensor {name!r} is not aligned to its item size", key=name
            )
        if out and small and not lone and out[-1][1] == start and start - out[-1][0] < GROUP_BYTES:
            lo, _, names = out[-1]
            out[-1] = (lo, start + n, [*names, name])
        else:
            out.append((start if lone else start - start % _ALIGN, start + n, [name]))
        small = not lone
    return out


def _jobs(
    groups: list[tuple[int, int, list[str]]],
    pieces: tuple[tuple[str, str, int, int, int], ...],
    files: dict[tuple[str, str], int],
) -> list[Job]:
    """The reads that fill ``groups`` from ``pieces`` (both in output order), at most PIECE
    bytes each; ``files`` gets an index for each file read."""
    jobs: list[Job] = []
    starts = [p[3] for p in pieces]
    for g, (glo, ghi, names) in enumerate(groups):
        del names
        i = max(bisect.bisect_right(starts, glo) - 1, 0)
        while i < len(pieces) and pieces[i][3] < ghi:
            root, path, offset, lo, hi = pieces[i]
            a, b = max(lo, glo), min(hi, ghi)
            if a < b:
                f = files.setdefault((root, path), len(files))
                for at in range(a, b, PIECE):
                    n = min(PIECE, b - at)
                    jobs.append((f, offset + at - lo, g, at - glo, n))
            i += 1
    return jobs


@contextlib.contextmanager
def _opened(direct: DirectRead, files: dict[tuple[str, str], int]) -> Iterator[list[int]]:
    """Each file's descriptor, opened as the daemon's storage opens it."""
    fds: list[int] = []
    storages: dict[str, LocalStorage] = {}
    try:
        for root, path in files:
            storage = storages.get(root) or storages.setdefault(root, LocalStorage(root))
            with _named(direct, path):
                fds.append(storage._open_regular("open", path)[0])
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


@contextlib.contextmanager
def _named(direct: DirectRead, path: str) -> Iterator[None]:
    """A failure to read another step's file that holds some of the shard's blocks is the
    checkpoint's: a CorruptCheckpointError naming both (as the daemon's reads say it)."""
    try:
        yield
    except StorageError as e:
        where, step = direct.files[path]
        if step is None:
            raise
        raise CorruptCheckpointError(
            f"{where}: written by step {step} and referenced by {direct.where}, cannot be "
            f"read: {e}",
            path=where,
        ) from None


def read_direct(reply: LoadReply) -> dict[str, torch.Tensor]:
    """The tensors of ``reply`` (LoadReply.direct), read from its files into memory of their
    own and checked, each against its crc32c."""
    direct = reply.direct
    assert direct is not None
    specs = reply.tensors
    groups = _groups(specs)
    bufs = [torch.empty(hi - lo, dtype=torch.uint8) for lo, hi, _ in groups]
    mems = [b.numpy().data.cast("B") for b in bufs]
    files: dict[tuple[str, str], int] = {}
    jobs = _jobs(groups, direct.pieces, files)
    # Each tensor's bytes as (group, start, end in the group), by the group's starts.
    spans = [
        sorted((specs[n][2] - lo, specs[n][2] - lo + _nbytes(specs[n]), n) for n in names)
        for lo, _, names in groups
    ]
    paths = list(files)
    with _opened(direct, files) as fds:

        def run(job: Job) -> list[tuple[str, int, int, int]]:
            f, offset, g, at, n = job
            root, path = paths[f]
            with mems[g][at : at + n] as view, _named(direct, path):
                _read_all(fds[f], view, offset, os.path.join(root, path), offset + n)
            return _crcs(mems[g], spans[g], at, at + n)

        futures = [_pool().submit(run, job) for job in jobs]
        concurrent.futures.wait(futures)
        parts = [part for fut in futures for part in fut.result()]
    _check(direct, parts, specs)
    out: dict[str, torch.Tensor] = {}
    for (lo, _, names), buf in zip(groups, bufs, strict=True):
        out.update(views(buf, {n: _at(specs[n], lo) for n in names}))
    return out


def _nbytes(spec: TensorAt) -> int:
    n = fmt.DTYPE_SIZES[spec[0]]
    for d in spec[1]:
        n *= d
    return n


def _at(spec: TensorAt, lo: int) -> TensorAt:
    return (spec[0], spec[1], spec[2] - lo)


def _crcs(
    mem: memoryview, spans: list[tuple[int, int, str]], a: int, b: int
) -> list[tuple[str, int, int, int]]:
    """(name, start, crc32c, length) of each tensor's part of bytes [a, b) of ``mem``."""
    out = []
    i = max(bisect.bisect_right(spans, (a, a, "")) - 1, 0)
    while i < len(spans) and spans[i][0] < b:
        lo, hi, name = spans[i]
        x, y = max(lo, a), min(hi, b)
        if x < y:
            with mem[x:y] as view:
                out.append((name, x, int(crc32c.crc32c(view)), y - x))
        i += 1
    return out


def _check(
    direct: DirectRead,
    parts: list[tuple[str, int, int, int]],
    specs: dict[str, TensorAt],
) -> None:
    """Raise for the first tensor whose bytes fail their crc32c, naming it and its files."""
    by_name: dict[str, list[tuple[int, int, int]]] = {}
    for name, at, crc, n in parts:
        by_name.setdefault(name, []).append((at, crc, n))
    for name in sorted(specs, key=lambda n: specs[n][2]):
        got = sorted(by_name.get(name, ()))
        crc = got[0][1] if got else 0
        for _, part, n in got[1:]:
            crc = combine(crc, part, n)
        if crc != direct.crcs[name]:
            held = _files_of(direct, specs[name])
            raise CorruptCheckpointError(
                f"{direct.where}: tensor {name!r} failed its crc32c check{held}",
                path=direct.where,
                key=name,
            )


def _files_of(direct: DirectRead, spec: TensorAt) -> str:
    """The files holding a tensor's bytes, with the step that wrote each that is another
    step's, for a message ('' when the shard's own file holds them all)."""
    lo = spec[2]
    hi = lo + _nbytes(spec)
    names = []
    for _, path, _, a, b in direct.pieces:
        if a < hi and b > lo:
            where, step = direct.files[path]
            names.append(where if step is None else f"{where} (written by step {step})")
    shown = ", ".join(dict.fromkeys(names))
    return "" if shown == direct.where else f" (its bytes are in {shown})"
