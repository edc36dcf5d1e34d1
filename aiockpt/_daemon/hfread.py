"""Hugging Face safetensors sources read for a load (``load_safetensors``): a ``.safetensors``
file, or a folder holding ``model.safetensors``, or ``model.safetensors.index.json`` and its
shards, or shards with no index (every ``*.safetensors`` file of the folder), on any storage
aiockpt opens (a local path, an fsspec URL, a plugin's). A local source is read where it
lies, through symbolic links (the Hugging Face hub cache's snapshots are links to its blobs),
but only ever from regular files (:class:`SourceFiles`).

:func:`describe` reads and checks every header (see :mod:`aiockpt._core.hfformat`) and says
where each tensor lies; the trainer then asks (:func:`read`) for what it needs: whole
tensors, read as runs of back-to-back byte ranges, and boxes of tensors (a rank's local
chunk of a DTensor), each tensor seen as one saved chunk so that the
:class:`~aiockpt._core.reshard.Assembler` reads only the one byte range that holds the
box's runs (a dim-0 box of a row-major tensor is one range, read straight into place).
The bytes go into a new shared-memory segment the trainer takes over, as ``load()``'s do.
Safetensors files carry no checksums: sizes and offsets are what is verified.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import errno
import math
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, NamedTuple

from .._core import hfformat as hf
from .._core import shm
from .._core.chunks import Chunk, read_plan
from .._core.dtable import ChunkRecord
from .._core.dtypes import DTYPE_SIZES
from .._core.protocol import LoadReply, SafetensorsInfo, TensorAt
from .._core.reshard import OUT_ALIGN, Assembler
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StagingMemoryError,
    StorageError,
)
from ..storage import LocalStorage, Storage, open_storage

__all__ = ["Source", "SourceFiles", "describe", "read"]

#: The first read of a header: enough for a few hundred tensors.
HEAD_PEEK = 64 * 1024
#: Runs are read this much at a time, READERS pieces at once.
READ_PIECE = 8 * 1024 * 1024
READERS = 4
#: madvise(2)'s MADV_POPULATE_WRITE (Linux 5.14), which the mmap module may not name.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: A run of this many bytes or more is placed so that its file offsets and its place in the
#: segment agree modulo the page size: local storage then reads it past the page cache.
DIRECT_MIN = 1 << 20
PAGE = 4096

#: What the trainer asks to read: (name, file, dtype, shape, start, box or None).
ReadItem = tuple[str, str, str, tuple[int, ...], int, Any]


class Source:
    """A safetensors file or folder, opened: its storage, and the file names to read."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.url = url.rstrip("/") or url
        self.single: str | None
        folder, sep, name = self.url.rpartition("/")
        if name.endswith(".safetensors"):
            self.folder, self.single = (folder or "/") if sep else ".", name
        else:
            self.folder, self.single = self.url, None
        self.storage: Storage = open_source(self.folder, options)

    def where(self, name: str) -> str:
        """The URL of a file of the source."""
        return f"{self.folder.rstrip('/')}/{name}"

    def files(self) -> tuple[dict[str, str] | None, list[str], dict[str, Any]]:
        """The index's weight map (None without one), the files to read, and the index's
        metadata."""
        if self.single is not None:
            if not self.storage.exists(self.single):
                raise CheckpointNotFoundError(f"{self.url}: no such safetensors file")
            return None, [self.single], {}
        if self.storage.exists(hf.INDEX):
            path = self.where(hf.INDEX)
            size = self.storage.size(hf.INDEX)
            if size > hf.MAX_INDEX:
                raise CorruptCheckpointError(
                    f"{path}: bad safetensors index: {size} bytes", path=path
                )
            weight_map, meta = hf.parse_index(self.storage.read_range(hf.INDEX, 0, size), path=path)
            return weight_map, sorted(set(weight_map.values())), meta
        if self.storage.exists(hf.SINGLE):
            return None, [hf.SINGLE], {}
        shards = [
            n
            for n in self.storage.list_dir("")
            if n.endswith(".safetensors") and not n.startswith(".") and hf.plain_name(n)
        ]
        if shards:
            return None, shards, {}
        raise CheckpointNotFoundError(
            f"{self.url}: no safetensors here (neither a .safetensors file, nor a folder "
            f"holding {hf.SINGLE}, {hf.INDEX} or other .safetensors files)"
        )

    def header(self, name: str) -> hf.FileHeader:
        """The checked header of file ``name``."""
        path = self.where(name)
        if not self.storage.exists(name):
            raise CorruptCheckpointError(f"{path}: the shard the index names is missing", path=path)
        size = self.storage.size(name)
        first = self.storage.read_range(name, 0, min(size, HEAD_PEEK))
        end = hf.header_end(first, size, path=path)
        if end > len(first):
            first += self.storage.read_range(name, len(first), end)
        return hf.parse_file_header(first[:end], size, path=path)

    def close(self) -> None:
        self.storage.close()


class SourceFiles(LocalStorage):
    """The local folder of a source the user named, read where it lies: a symbolic link is
    followed (the hub cache's ``snapshots/<rev>/<file>`` are relative links to
    ``../../blobs/<hash>``), but only to a regular file. What a link leads to is looked at
    before it is opened, and what was opened is checked again with ``fstat`` before a byte
    is read: a FIFO, a socket, a device or a directory is an :class:`UnsafeFileError`. Read,
    never written: the roots aiockpt writes and deletes in keep :class:`LocalStorage`'s rule
    that nothing under them is reached through a link."""

    def _open_regular(self, op: str, path: str) -> tuple[int, os.stat_result]:
        full = os.path.join(self.root, *self._names(path))  # ".." refused
        try:
            mode = os.stat(full).st_mode
            if not stat.S_ISREG(mode):
                raise self._not_regular(op, path, mode)
            fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if isinstance(e, StorageError):
                raise
            raise self._error(op, path, e) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # replaced since it was looked at
                raise self._not_regular(op, path, st.st_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd, st


def open_source(folder: str, options: dict[str, Any]) -> Storage:
    """The storage that reads the source's ``folder``: :class:`SourceFiles` where it is a
    local path, what serves its URL otherwise."""
    storage = open_storage(folder, options)
    if type(storage) is LocalStorage:  # not a plugin's, nor a test's subclass
        storage.close()
        return SourceFiles(storage.root, url=storage.url)
    return storage


def describe(source: Source) -> SafetensorsInfo:
    """Every tensor of ``source``: where it lies, its dtype and shape, every header checked."""
    weight_map, files, meta = source.files()
    tensors: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
    for name in files:
        head = source.header(name)
        if weight_map is None:
            meta = dict(head.metadata)
        for key, (dtype, shape, start, end) in head.tensors.items():
            if weight_map is None and key in tensors:  # shards with no index to choose
                path = source.where(tensors[key][0])
                raise CorruptCheckpointError(
                    f"{source.url}: tensor {key!r} is in two shards, {path} and "
                    f"{source.where(name)}, and no {hf.INDEX} says which to load",
                    path=source.where(name),
                    key=key,
                )
            if weight_map is None or weight_map.get(key) == name:
                tensors[key] = (name, dtype, shape, start, end)
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in tensors:
                path = source.where(hf.INDEX)
                raise CorruptCheckpointError(
                    f"{path}: the index puts tensor {key!r} in {name}, whose header lacks it",
                    path=path,
                    key=key,
                )
    return SafetensorsInfo(source.url, tensors, meta)


class _Whole(NamedTuple):
    """One tensor of a file as the one chunk that holds all of it (see reshard.Covered)."""

    name: str
    dtype: str
    saved: ChunkRecord

    def covering(self, box: Chunk) -> list[ChunkRecord]:
        return [self.saved]


class _Run(NamedTuple):
    """Back-to-back tensors of one file: bytes [lo, hi), read to ``base`` of the segment."""

    file: str
    lo: int
    hi: int
    items: list[tuple[str, str, tuple[int, ...], int]]
    base: int = 0


def runs_of(whole: list[ReadItem]) -> list[_Run]:
    """Whole tensors as runs of back-to-back byte ranges of one file, in file order; a tensor
    joins a run only where its item size divides its distance from the run's start."""
    runs: list[_Run] = []
    for name, file, dtype, shape, start, _ in sorted(whole, key=lambda i: (i[1], i[4])):
        end = start + math.prod(shape) * DTYPE_SIZES[dtype]
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.file == file
            and last.hi == start
            and (start - last.lo) % DTYPE_SIZES[dtype] == 0
        ):
            last.items.append((name, dtype, shape, start))
            runs[-1] = last._replace(hi=end)
        else:
            runs.append(_Run(file, start, end, [(name, dtype, shape, start)]))
    return runs


def place(runs: list[_Run]) -> tuple[list[_Run], int]:
    """Each run's place in the segment, and where they end: 64-byte aligned, and a large run
    whose start is 8-byte aligned in its file at the same offset modulo the page size."""
    placed, pos = [], 0
    for run in runs:
        pos = (pos + OUT_ALIGN - 1) // OUT_ALIGN * OUT_ALIGN
        if run.hi - run.lo >= DIRECT_MIN and run.lo % 8 == 0:
            pos += (run.lo - pos) % PAGE
        placed.append(run._replace(base=pos))
        pos += run.hi - run.lo
    return placed, pos


def place_boxes(
    pos: int, parts: list[ReadItem], boxes: list[tuple[str, str, Chunk]]
) -> tuple[dict[str, int], int]:
    """Where each box goes in the segment after ``pos`` bytes, and where they end: as
    reshard.out_offsets places them, and a large box that is one run of its tensor (a dim-0
    piece) at its file offset modulo the page size, as place() does a run."""
    out_at: dict[str, int] = {}
    for (_, _, _, shape, start, _), (name, dtype, box) in zip(parts, boxes, strict=True):
        pos = (pos + OUT_ALIGN - 1) // OUT_ALIGN * OUT_ALIGN
        itemsize = DTYPE_SIZES[dtype]
        nbytes = box.numel * itemsize
        if nbytes >= DIRECT_MIN:
            runs = read_plan(Chunk((0,) * len(shape), tuple(shape)), box, itemsize)
            first = start + runs[0].src_start
            if len(runs) == 1 and first % 8 == 0:
                pos += (first - pos) % PAGE
        out_at[name] = pos
        pos += nbytes
    return out_at, pos


def pieces(lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) cut at the first page boundary of the file, then every READ_PIECE bytes."""
    first = min(hi, (lo + PAGE - 1) // PAGE * PAGE)
    if first > lo:
        yield lo, first
    for a in range(first, hi, READ_PIECE):
        yield a, min(a + READ_PIECE, hi)


def read(
    source: Source, items: list[ReadItem], segments: set[str], pool: ThreadPoolExecutor
) -> LoadReply:
    """Read ``items`` (whole tensors, and boxes of tensors) into a new segment, whose name is
    added to ``segments`` (the daemon unlinks them at exit); where each lies in it."""
    whole, parts = [], []
    for item in items:
        _, _, _, shape, _, box = item
        if box is None or tuple(map(tuple, box)) == ((0,) * len(shape), tuple(shape)):
            whole.append(item)
        else:
            parts.append(item)
    runs, pos = place(runs_of(whole))
    boxes = [(i[0], i[2], Chunk(tuple(i[5][0]), tuple(i[5][1]))) for i in parts]
    out_at, size = place_boxes(pos, parts, boxes)
    tensors: dict[str, TensorAt] = {}
    for run in runs:
        for name, dtype, shape, start in run.items:
            tensors[name] = (dtype, shape, run.base + start - run.lo)
    for name, dtype, box in boxes:
        tensors[name] = (dtype, box.sizes, out_at[name])
    seg = FreshSegment(size)
    segments.add(seg.name)
    try:
        nread = _fill(source, runs, parts, boxes, out_at, seg, pool)
    except BaseException:
        seg.close()
        seg.unlink()
        segments.discard(seg.name)
        raise
    # The trainer maps it and takes it over. Unmapping hundreds of MiB of populated pages
    # takes tens of milliseconds: a thread of its own does it once the reply is on its way.
    threading.Thread(target=seg.close, name="aiockpt-hf-unmap", daemon=True).start()
    nbytes = sum(math.prod(i[3]) * DTYPE_SIZES[i[2]] for i in items)
    return LoadReply(
        step=0,
        segment=seg.name,
        size=size,
        tensors=tensors,
        tree=None,
        metrics={},
        metadata={},
        created_at=0.0,
        nbytes=nbytes,
        url=source.url,
        read_nbytes=nread,
    )


def _fill(
    source: Source,
    runs: list[_Run],
    parts: list[ReadItem],
    boxes: list[tuple[str, str, Chunk]],
    out_at: dict[str, int],
    seg: FreshSegment,
    pool: ThreadPoolExecutor,
) -> int:
    """Read the runs and the boxes into ``seg``; the bytes read. Every byte range that lands
    in one place (a run's pieces, a dim-0 box's) is one job; the jobs run READERS at a time,
    each making its part of the segment first (:meth:`FreshSegment.make`), so that one
    thread's pages are made while another's are read. A box of several runs (a later dim
    split) is assembled after, as the resharding reads do."""
    storage = source.storage
    jobs: list[tuple[str, int, int, int]] = []  # (file, file offset, segment offset, length)
    for run in runs:
        jobs += [(run.file, a, run.base + a - run.lo, b - a) for a, b in pieces(run.lo, run.hi)]
    scattered = []
    for item, (name, dtype, box) in zip(parts, boxes, strict=True):
        _, file, _, shape, start, _ = item
        itemsize = DTYPE_SIZES[dtype]
        plan = read_plan(Chunk((0,) * len(shape), tuple(shape)), box, itemsize) if box.numel else []
        if len(plan) == 1:
            lo, at = start + plan[0].src_start, out_at[name] + plan[0].dst_offset
            n = plan[0].src_end - plan[0].src_start
            jobs += [(file, a, at + a - lo, b - a) for a, b in pieces(lo, lo + n)]
        elif plan:
            scattered.append((item, box))

    def job(file: str, offset: int, at: int, n: int) -> None:
        seg.make(at, n)
        with seg.buf[at : at + n] as out:
            storage.readinto(file, offset, out)

    with ThreadPoolExecutor(READERS, thread_name_prefix="aiockpt-hf-read") as readers:
        futures = [readers.submit(job, *j) for j in sorted(jobs, key=lambda j: j[2])]
        wait(futures)
        for f in futures:
            f.result()  # the first failure, once none is still reading
        nread = sum(j[3] for j in jobs)
        assembler = Assembler(read_pieces(storage), pool, 1, source.where, checked=False)
        for (name, file, dtype, shape, start, _), box in scattered:
            end = start + math.prod(shape) * DTYPE_SIZES[dtype]
            whole = ChunkRecord(Chunk((0,) * len(shape), tuple(shape)), file, start, end, 0, ())
            n = box.numel * DTYPE_SIZES[dtype]
            seg.make(out_at[name], n)
            with seg.buf[out_at[name] : out_at[name] + n] as out:
                assembler.fill(_Whole(name, dtype, whole), box, out)
    return nread + assembler.read_bytes


def read_pieces(storage: Storage) -> Callable[[str, int, memoryview], None]:
    """``storage.readinto`` cut as :func:`pieces` cuts a run, so that what lies on pages in
    both the file and the segment is read past the page cache."""

    def read(file: str, offset: int, out: memoryview) -> None:
        for a, b in pieces(offset, offset + len(out)):
            with out[a - offset : b - offset] as view:
                storage.readinto(file, a, view)

    return read


class FreshSegment:
    """A new shared-memory segment whose pages are made a part at a time, as it is read.

    A new segment's pages cost more than the reads into them on a busy or virtualised
    host: allocating and zeroing them (``fallocate``), then, at the first write through the
    mapping, a fault per 4 KiB page (a read past the page cache pins them for writing). Made
    whole before the reads (``shm.Segment.create``), that cost adds to the reads'; made
    piece by piece by the threads that read (:meth:`make`: ``fallocate`` of the range, then
    ``MADV_POPULATE_WRITE``, which maps it in one call instead of a fault a page), it
    overlaps them. A /dev/shm too small is still a StagingMemoryError before any of the
    piece's bytes are read."""

    def __init__(self, size: int) -> None:
        self.name = shm.new_name("load")
        self.size = size
        fd = _posixshmem.shm_open(self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode=0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            self.mm = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            shm.unlink(self.name)
            raise
        self.fd: int | None = fd
        self.buf = memoryview(self.mm)

    def make(self, at: int, n: int) -> None:
        """Allocate and map bytes [at, at + n) (whole pages around them)."""
        if n <= 0 or self.fd is None:
            return
        lo, hi = at // PAGE * PAGE, min(self.size, at + n)
        try:
            os.posix_fallocate(self.fd, lo, hi - lo)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            raise StagingMemoryError(shm._short_of(self.size, "load")) from e
        with contextlib.suppress(OSError, ValueError):  # before Linux 5.14: faults instead
            self.mm.madvise(MADV_POPULATE_WRITE, lo, hi - lo)

    def close(self) -> None:
        """Unmap, and close the descriptor (again is a no-op)."""
        self.buf.release()
        self.mm.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def unlink(self) -> None:
        shm.unlink(self.name)
