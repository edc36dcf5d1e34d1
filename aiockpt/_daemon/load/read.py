"""Reading a planned load into shared memory: a whole shard checked by its own crc32c
(:func:`read_whole`), read as the file's image (:func:`read_as_image`), and the boxes of
distributed and borrowed tensors (:func:`assemble`)."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import crc32c

from ..._core import format as fmt
from ..._core.blocks import ShardMap
from ..._core.catalog import Catalog
from ..._core.chunks import Chunk
from ..._core.reshard import Assembler
from ..._core.shm import Segment
from ..._crc import combine
from .plan import _Plan, shard_of
from .verify import LOAD_CHUNK, check_crcs, crc_of


def read_as_image(
    plan: _Plan, storage: Any, image: tuple[int, bytes] | None, room: int
) -> tuple[_Plan, Callable[[_Plan], _Plan] | None]:
    """A load into a lent slab of ``room`` bytes asked to read the file's ``image`` (see
    LoadReq.image): ``plan`` reading a whole shard's tensors (see whole_shard) where the
    file has them, when the slab holds the whole file, and how to tell, while they are read,
    whether they are the image asked for (see as_image); else ``plan`` as it was, and None."""
    if image is None or plan.whole is None:
        return plan, None
    ((lo, hi, _),) = plan.ranges
    if hi > room:
        return plan, None
    return plan._replace(bases=[lo], size=hi), functools.partial(
        as_image, storage=storage, image=image
    )


def as_image(plan: _Plan, storage: Any, image: tuple[int, bytes]) -> _Plan:
    """``plan``, read at file offsets (see read_as_image), marked as the file's image when
    the shard's head is the header ``image`` describes (its length and sha256: LoadReq.image),
    which says where every tensor lies. The head is read for it, while the tensors are.

    The trainer's views of the slab for that layout are then the loaded tensors: the reply's
    place per tensor (pickled, sent, unpickled) and the trainer's views of them, Python work
    per tensor, are not made."""
    length, digest = image
    if length != plan.bases[0]:
        return plan
    head = bytearray(length)
    with memoryview(head) as out:
        plan.smap.readinto(storage, 0, out)
    return plan._replace(image=hashlib.sha256(head).digest() == digest)


def read_whole(
    storage: Any,
    pool: ThreadPoolExecutor,
    checks: list[Future[Any]],
    seg: Segment,
    plan: _Plan,
    known_head: bytes | None = None,
) -> int:
    """Read the one range of ``plan``, a shard's bytes [lo, nbytes), into ``seg``, taking the
    crc32c of each chunk on ``pool`` while the next is read (the futures added to ``checks``,
    for the caller to wait for); then read the head [0, lo) and check the shard's crc32c. Only
    if that fails are the tensors checked one by one, to name the first that is bad (when
    none is, the damage is in the head, which the load does not use). The bytes of the head
    read (``known_head``: the head as this load's header check read it, not read again)."""
    assert plan.whole is not None
    ((lo, hi, items),) = plan.ranges
    (base,) = plan.bases
    parts: list[tuple[Future[int], int]] = []
    for off in range(0, hi - lo, LOAD_CHUNK):
        end = min(off + LOAD_CHUNK, hi - lo)
        with seg.buf[base + off : base + end] as out:
            plan.smap.readinto(storage, lo + off, out)
        crc = pool.submit(crc_of, seg, base + off, base + end)
        checks.append(crc)
        parts.append((crc, end - off))
    head: bytes | bytearray
    if known_head is not None and len(known_head) == lo:
        head = known_head  # read by this load's header check: not again
    else:
        head = bytearray(lo)
        with memoryview(head) as out:
            plan.smap.readinto(storage, 0, out)
    total = crc32c.crc32c(head)
    for crc, n in parts:
        total = combine(total, crc.result(), n)
    if total != plan.whole.crc32c:
        check_crcs(seg, items, lo - base, plan.where, plan.smap)
    return lo


def assemble(
    catalog: Catalog,
    pool: ThreadPoolExecutor,
    plan: _Plan,
    boxes: list[tuple[str, str, Chunk]],
    out_at: dict[str, int],
    seg: Segment,
) -> Assembler | None:
    """Fill each of ``boxes`` of ``plan``, of a distributed tensor or a tensor borrowed
    from another rank's shard (``plan.borrowed``), into ``seg`` at ``out_at``."""
    if not boxes:
        return None
    m, step, borrowed = plan.m, plan.step, plan.borrowed
    maps: dict[str, ShardMap] = {}

    def read(shard: str, offset: int, out: memoryview) -> None:
        smap = maps.get(shard)
        if smap is None:
            record = next(s for s in m.shards if s.file == shard)
            shard_of(catalog, m, step, record.rank)  # there, at its size
            smap = maps[shard] = catalog.shard_map(step, record)
        smap.readinto(catalog.storage, offset, out)

    def where(shard: str) -> str:
        return catalog.where(f"{fmt.step_dirname(step)}/{shard}")

    assembler = Assembler(read, pool, m.block_bytes, where)
    try:
        for name, dtype, box in boxes:
            n = box.numel * fmt.DTYPE_SIZES[dtype]
            with seg.buf[out_at[name] : out_at[name] + n] as out:
                assembler.fill(borrowed.get(name) or m.dtensors[name], box, out)
    finally:
        assembler.wait()
    return assembler
