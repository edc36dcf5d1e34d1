"""Whole tensors out of a checkpoint, without torch: ``aiockpt export``.

Export writes a checkpoint's tensors as a plain safetensors file (or a Hugging Face sharded
layout: numbered files plus ``model.safetensors.index.json``) that ``safetensors.torch``
loads into an unsharded model. A distributed tensor is assembled whole from its saved chunks
(:class:`~aiockpt._core.reshard.Assembler`, which checks each chunk's crc32c); a plain tensor
is rank 0's, checked against its record's crc32c. Every dtype and shape is known from the
manifest, so each file's header is written first and then each tensor's bytes as they are
assembled, one tensor at a time: memory is bounded by the largest tensor, not the checkpoint.
Each output is written under a temporary name and renamed into place, so a failed export
leaves nothing. A tensor saved under several names (tied weights) is written once, under its
first name, as ``save_pretrained`` writes it; the file's metadata maps each other name to it,
as ``safetensors.torch.save_model`` records the names it drops.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import crc32c

from ._core import format as fmt
from ._core.blocks import ShardMap
from ._core.casts import FLOATING, cast_bytes
from ._core.catalog import Catalog
from ._core.chunks import Chunk
from ._core.dtable import DTensorRecord
from ._core.lease import LEASE_DIR
from ._core.reshard import Assembler
from ._core.tree import DTENSOR, TENSOR, walk
from .errors import CorruptCheckpointError

__all__ = [
    "INDEX",
    "ExportError",
    "Exported",
    "Item",
    "export",
    "parse_size",
    "plan_files",
    "select",
]

#: The index of a sharded export, and the file of a directory export that needs only one.
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: What a safetensors header says made the file; transformers warns on files without it.
HEADER_METADATA = {"format": "pt"}

#: Told the bytes of each tensor written: ``progress(nbytes, total)``, ``total`` the bytes of
#: all the tensors the export writes.
Progress = Callable[[int, int], None]


class ExportError(ValueError):
    """What was asked cannot be exported (a prefix that matches nothing, state that differs
    between ranks, an output path in the way): a usage error for the command line."""


# --------------------------------------------------------------------------- sizes


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """A size in bytes from ``500MB``, ``5GB``, ``10KiB``, ``1.5GiB`` or ``4096``.

    KB, MB, GB, TB are powers of 1000 (as in ``transformers``' ``max_shard_size``); KiB, MiB,
    GiB, TiB powers of 1024; units are case-insensitive. Raises ValueError unless it is at
    least one byte."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"not a size: {text!r} (expected a number of bytes with an optional unit: B, KB, "
            "MB, GB, TB, KiB, MiB, GiB, TiB; e.g. 5GB or 500MiB)"
        )
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"a size must be at least 1 byte, not {text!r}")
    return value


# --------------------------------------------------------------------------- what to write


@dataclass(frozen=True, slots=True)
class Item:
    """One tensor of an export: its name in the output, where it comes from, and what it is.
    ``record`` is rank 0's plain tensor, ``dtensor`` a distributed tensor; one is None."""

    name: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    record: fmt.TensorRecord | None = None
    dtensor: DTensorRecord | None = None
    #: The dtype written, when it is cast (``--dtype``); None: as saved.
    to: str | None = None
    #: The other names of a tied tensor (saved under several key paths), not written.
    tied: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes, as saved."""
        return math.prod(self.shape) * fmt.DTYPE_SIZES[self.dtype]

    @property
    def out_dtype(self) -> str:
        """The dtype written."""
        return self.to or self.dtype

    @property
    def out_nbytes(self) -> int:
        """The tensor's size in bytes, as written."""
        return math.prod(self.shape) * fmt.DTYPE_SIZES[self.out_dtype]


def cast_to(items: list[Item], dtype: str | None) -> list[Item]:
    """``items`` with their floating tensors written as ``dtype`` (``BF16`` or ``F16``; None:
    every tensor as saved); integers, booleans and fp8 are written as they are."""
    if dtype is None:
        return items
    return [
        dataclasses.replace(i, to=dtype) if i.dtype in FLOATING and i.dtype != dtype else i
        for i in items
    ]


def select(m: fmt.Manifest, prefix: str | None, *, where: str) -> list[Item]:
    """The tensors of rank 0's tree, in tree order, named by their key path joined by "/"
    (with ``prefix``: only those under it, named by the rest of their path).

    A tensor under several key paths (tied weights) is one item, of its first name; its
    other names are the item's ``tied``.

    Raises :class:`ExportError` when nothing matches, when two tensors would get one name,
    or, for a checkpoint of several ranks, when a plain tensor is not the same on every rank
    (its "whole" would be a guess); :class:`CorruptCheckpointError` for a malformed tree."""
    records = m.tensors[m.shard_of(0).file]
    tree = m.trees[0]
    fmt.check_tree(tree, set(records), path=where, dtensor_names=set(m.dtensors))
    head = f"{prefix.strip('/')}/" if prefix is not None else ""
    dtensors = set(m.dtensors)
    items: dict[str, Item] = {}
    first: dict[tuple[str, str], str] = {}  # each tensor's first name, by (tag, body)
    for path, tag, body, _ in walk(tree, dtensor_names=dtensors):
        if tag not in (TENSOR, DTENSOR) or not path.startswith(head):
            continue
        name = path[len(head) :]
        if not name or name in items or name == "__metadata__":  # safetensors reserves it
            raise ExportError(
                f"cannot name a tensor {name!r} in safetensors (empty, reserved, "
                "or taken by another tensor)"
            )
        kept = first.setdefault((tag, body), name)
        if kept != name:  # tied: safetensors holds no two names for one tensor
            items[kept] = dataclasses.replace(items[kept], tied=(*items[kept].tied, name))
        elif tag == TENSOR:
            r = records[body]
            items[name] = Item(name, body, r.dtype, r.shape, record=r)
        else:
            d = m.dtensors[body]
            items[name] = Item(name, body, d.dtype, d.shape, dtensor=d)
    if not items:
        what = f"under the prefix {prefix!r}" if prefix is not None else "at all"
        raise ExportError(f"step {m.step} holds no tensors {what}{_top_keys(tree, dtensors)}")
    _check_replicated(m, [i for i in items.values() if i.record is not None])
    return list(items.values())


def _top_keys(tree: Any, dtensors: set[str]) -> str:
    """Where the tree's tensors are, for a prefix that matched none of them."""
    keys = sorted(
        {
            path.split("/", 1)[0]
            for path, tag, _, _ in walk(tree, dtensor_names=dtensors)
            if tag in (TENSOR, DTENSOR) and path
        }
    )
    return f" (its tensors are under: {', '.join(keys)})" if keys else ""


def _check_replicated(m: fmt.Manifest, plain: list[Item]) -> None:
    """Refuse plain tensors that some rank saved differently from rank 0 (or not at all)."""
    differ = []
    for item in plain:
        r = cast(fmt.TensorRecord, item.record)
        for shard in m.shards:
            other = m.tensors[shard.file].get(item.key)
            if other is None or (other.dtype, other.shape, other.crc32c) != (
                r.dtype,
                r.shape,
                r.crc32c,
            ):
                differ.append(item.key)
                break
    if differ:
        shown = ", ".join(differ[:8]) + (", …" if len(differ) > 8 else "")
        raise ExportError(
            f"step {m.step} was saved by {m.world_size} ranks and these plain tensors differ "
            f"between them, so there is no one whole value to export: {shown} (--prefix "
            "exports only the part of the state under it, e.g. --prefix model)"
        )


def plan_files(items: Sequence[Item], max_size: int | None) -> list[list[Item]]:
    """The items of each output file, in order: all in one without ``max_size``; otherwise
    filled in order up to ``max_size`` bytes of tensor data each (a larger tensor gets a
    file of its own), as ``transformers`` shards a model."""
    files: list[list[Item]] = [[]]
    size = 0
    for item in items:
        if max_size is not None and files[-1] and size + item.out_nbytes > max_size:
            files.append([])
            size = 0
        files[-1].append(item)
        size += item.out_nbytes
    return files


# --------------------------------------------------------------------------- reading


class Source:
    """Reads the verified bytes of export items from one step of a root."""

    def __init__(self, catalog: Catalog, m: fmt.Manifest, pool: ThreadPoolExecutor) -> None:
        self.catalog = catalog
        self.m = m
        self.dir = fmt.step_dirname(m.step)
        self.shards = {s.file: s for s in m.shards}
        self.maps: dict[str, ShardMap] = {}
        self.assembler = Assembler(self.read, pool, m.block_bytes, self.where)

    def where(self, shard: str) -> str:
        """The URL of a shard of the step."""
        return self.catalog.where(f"{self.dir}/{shard}")

    def read(self, shard: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from ``shard`` at ``offset``, once the shard is known to be there at
        the size the manifest says."""
        smap = self.maps.get(shard)
        if smap is None:
            record = self.shards[shard]
            actual = self.catalog.storage.size(f"{self.dir}/{shard}")
            if actual != record.file_size:
                raise CorruptCheckpointError(
                    f"{self.where(shard)}: {actual} bytes on storage, the manifest says "
                    f"{record.file_size}",
                    path=self.where(shard),
                )
            smap = self.maps[shard] = self.catalog.shard_map(self.m.step, record)
        smap.readinto(self.catalog.storage, offset, out)

    def fill(self, item: Item, out: memoryview) -> None:
        """The whole of ``item`` into ``out``, checked against its crcs."""
        if item.dtensor is not None:
            whole = Chunk((0,) * len(item.shape), item.shape)
            try:
                self.assembler.fill(item.dtensor, whole, out)
            finally:
                self.assembler.wait()
            return
        r = cast(fmt.TensorRecord, item.record)
        self.read(r.shard, r.start, out)
        if crc32c.crc32c(out) != r.crc32c:
            where = self.where(r.shard)
            raise CorruptCheckpointError(
                f"{where}: tensor {item.key!r} failed its crc32c check", path=where, key=item.key
            )


# --------------------------------------------------------------------------- writing


@dataclass(frozen=True, slots=True)
class Exported:
    """What an export wrote: its safetensors files and index (paths in the final output, the
    index None for a single file), how many tensors, their bytes, and the other names of
    each tied tensor (by the name written)."""

    files: list[str]
    index: str | None
    tensors: int
    nbytes: int
    tied: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


def export(
    catalog: Catalog,
    m: fmt.Manifest,
    out: str,
    *,
    prefix: str | None = None,
    max_shard_size: int | None = None,
    progress: Progress = lambda n, total: None,
    dtype: str | None = None,
) -> Exported:
    """Export step ``m`` of ``catalog``'s root to the local path ``out``.

    Without ``max_shard_size``, ``out`` is the safetensors file to write (an existing file is
    replaced). With it, ``out`` is a directory, which must not exist or be empty: it gets
    ``model.safetensors`` when every tensor fits in one file of that size, else
    ``model-00001-of-0000K.safetensors`` … and ``model.safetensors.index.json``. ``progress``
    is told the bytes of each tensor written, and of all. ``dtype`` (``BF16``, ``F16``)
    writes the floating tensors in it (see cast_to)."""
    where = catalog.where(f"{fmt.step_dirname(m.step)}/{fmt.MANIFEST}")
    items = cast_to(select(m, prefix, where=where), dtype)
    files = plan_files(items, max_shard_size)
    target = os.path.abspath(out)
    _check_target(target, directory=max_shard_size is not None)
    _check_outside_roots(out, getattr(catalog.storage, "root", None))
    parent, base = os.path.split(target)
    tmp = os.path.join(parent, f".{base}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    largest = max(item.nbytes for item in items)
    total = sum(item.out_nbytes for item in items)

    def written(n: int) -> None:
        progress(n, total)

    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        source = Source(catalog, m, pool)
        buf = bytearray(max(largest, 1))  # one buffer, reused: memory is the largest tensor
        try:
            if max_shard_size is None:
                _write_file(tmp, items, source, buf, written)
                names, index = [target], None
            else:
                os.mkdir(tmp)
                names, index = _write_dir(tmp, files, source, buf, written)
                _fsync_dir(tmp)
                names = [os.path.join(target, n) for n in names]
                index = index and os.path.join(target, index)
            os.replace(tmp, target)
            _fsync_dir(parent)
        except BaseException:
            _remove(tmp)
            raise
    tied = {i.name: i.tied for i in items if i.tied}
    return Exported(names, index, len(items), total, tied)


def _check_target(target: str, *, directory: bool) -> None:
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise ExportError(f"the directory {parent} does not exist")
    if directory:
        if os.path.lexists(target) and not (os.path.isdir(target) and not os.listdir(target)):
            raise ExportError(
                f"{target} exists and is not an empty directory (with --max-shard-size OUT is "
                "the directory to create)"
            )
    elif os.path.isdir(target):
        raise ExportError(
            f"{target} is a directory; OUT is the file to write (or pass --max-shard-size "
            "for a directory of files)"
        )


def _check_outside_roots(out: str, source: str | None) -> None:
    """Refuse an ``out`` inside the root exported (``source``, its local directory when it
    has one) or inside any aiockpt root: the export would replace a checkpoint's manifest or
    shard, or put a file among the lease's that every later writer reads as the lease.
    Symbolic links are followed, so a link into a root is refused too."""
    real = os.path.realpath(out)
    if source is not None:
        root = os.path.realpath(source)
        if os.path.commonpath([real, root]) == root:
            raise ExportError(
                f"{out} is inside the checkpoint root {source} being exported; write the "
                "export outside it"
            )
    here = os.path.dirname(real)
    while True:
        if _is_root(here):
            raise ExportError(
                f"{out} is inside the checkpoint root {here}; write the export outside it"
            )
        up = os.path.dirname(here)
        if up == here:
            return
        here = up


def _is_root(path: str) -> bool:
    """Whether the local directory ``path`` is an aiockpt root: it holds the lease directory,
    or a step directory with a manifest."""
    if os.path.isdir(os.path.join(path, LEASE_DIR)):
        return True
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(
        fmt.parse_step_dirname(n) is not None
        and os.path.isfile(os.path.join(path, n, fmt.MANIFEST))
        for n in names
    )


def _write_dir(
    tmp: str,
    files: list[list[Item]],
    source: Source,
    buf: bytearray,
    progress: Callable[[int], None],
) -> tuple[list[str], str | None]:
    """Write the files of a directory export into ``tmp``; the names of its safetensors files,
    and of its index (None for a single file)."""
    if len(files) == 1:
        _write_file(os.path.join(tmp, SINGLE), files[0], source, buf, progress)
        return [SINGLE], None
    names = [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    weight_map = {}
    for name, part in zip(names, files, strict=True):
        _write_file(os.path.join(tmp, name), part, source, buf, progress)
        weight_map.update(dict.fromkeys((i.name for i in part), name))
    total = sum(i.out_nbytes for part in files for i in part)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(tmp, INDEX), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return names, INDEX


def _write_file(
    path: str, items: list[Item], source: Source, buf: bytearray, progress: Callable[[int], None]
) -> None:
    """One safetensors file of ``items``: the header, then each tensor as it is read."""
    # Largest item size first, as the shards are: every tensor naturally aligned, no padding.
    order = sorted(items, key=lambda i: -fmt.DTYPE_SIZES[i.out_dtype])
    specs, pos = [], 0
    for item in order:
        n = item.out_nbytes
        specs.append(fmt.TensorSpec(item.name, item.out_dtype, item.shape, pos, pos + n))
        pos += n
    # Each tied name, to the name written (as safetensors.torch.save_model records them).
    metadata = {alias: i.name for i in items for alias in i.tied} | HEADER_METADATA
    with open(path, "wb") as f:
        f.write(fmt.build_header(specs, metadata))
        for item in order:
            with memoryview(buf)[: item.nbytes] as view:
                source.fill(item, view)
                f.write(view if item.to is None else cast_bytes(view, item.dtype, item.to))
            progress(item.out_nbytes)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)
