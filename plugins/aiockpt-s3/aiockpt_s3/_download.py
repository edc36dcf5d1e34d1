"""Ranged reads: an object's bytes fetched in parts, concurrently, into the caller's buffer.

A read is split into parts of about ``read_part_size`` bytes (equal ones: no small tail part
waits alone at the end), ``read_concurrency`` of them in flight at once. Each part is one GET
with a ``Range`` header whose body is streamed straight into its slice of the caller's buffer
as it arrives (no part-sized bytes object, no copy of the whole). A part that fails on a
transient error (5xx, throttling, a reset connection, a body cut short) is retried on its own,
from where it stopped: the retry asks only for the bytes still missing, of the same version of
the object (``If-Match`` its ETag).
"""

from __future__ import annotations

import errno
import functools
from typing import Any

from botocore.exceptions import IncompleteReadError

from aiockpt.errors import StorageError
from aiockpt.storage.objects import GaveUp, gather_or_cancel

from ._client import BucketClient
from ._errors import error_code

#: Bytes asked of a body at a time where it is not aiohttp's (which hands over what came in).
_CHUNK = 1024 * 1024


def split(size: int, part_size: int) -> list[tuple[int, int]]:
    """[lo, hi) of each part of ``size`` bytes: as few as parts of at most ``part_size`` allow,
    of equal sizes (give or take a byte)."""
    n = -(-size // part_size)
    return [(size * i // n, size * (i + 1) // n) for i in range(n)]


class _Part:
    """One range [lo, hi) of the read; ``done`` bytes of it are in place (kept across
    retries)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi, self.done = lo, hi, 0

    async def fill(self, body: Any, out: memoryview) -> None:
        """Copy ``body`` into the part's missing bytes of ``out`` as it arrives, counting what
        landed; stops at the body's end or the part's (the caller tells which)."""
        content = getattr(getattr(body, "raw_stream", None), "content", None)
        with out[self.lo + self.done : self.hi] as view:
            pos = 0
            while pos < len(view):
                if content is not None:  # aiohttp: the chunks as they came off the socket
                    chunk = await content.readany()
                else:
                    chunk = await body.read(min(_CHUNK, len(view) - pos))
                n = len(chunk)
                if not n:
                    break
                if pos + n > len(view):
                    raise ValueError(f"the body is longer than the {len(view)} bytes asked for")
                view[pos : pos + n] = chunk
                pos += n
                self.done += n


async def download_into(
    client: BucketClient, key: str, offset: int, out: memoryview, part_size: int, concurrency: int
) -> None:
    """Fill ``out`` with the bytes of ``key`` from ``offset`` on: ranged GETs of about
    ``part_size`` bytes, ``concurrency`` at once, each retried from where it stopped."""
    if not len(out):
        await client.head("read", key)  # nothing to read, but the object must exist
        return
    session = await client.session()
    where = client.where(key)
    parts = [_Part(lo, hi) for lo, hi in split(len(out), part_size)]
    todo = iter(parts)
    etag: list[str] = []  # the version read first; retries and later parts read the same

    async def fetch(part: _Part) -> None:
        start, end = offset + part.lo + part.done, offset + part.hi
        kwargs: dict[str, Any] = {"Range": f"bytes={start}-{end - 1}"}
        if etag:
            kwargs["IfMatch"] = etag[0]
        reply = await session.get_object(Bucket=client.bucket, Key=key, **kwargs)
        if reply.get("ETag") and not etag:
            etag.append(reply["ETag"])
        length = reply.get("ContentLength")
        async with reply["Body"] as body:
            if length is not None and length < end - start:  # what the object holds
                raise StorageError(
                    f"read {where} failed: the object ends before byte {offset + len(out)}",
                    path=where,
                    errno=errno.EIO,
                )
            if length is not None and length > end - start:
                raise StorageError(
                    f"read {where} failed: the server answered a range of {end - start} "
                    f"bytes with {length} (does it ignore Range headers?)",
                    path=where,
                    errno=errno.EIO,
                )
            before = part.done
            await part.fill(body, out)
            if part.lo + part.done < part.hi:  # the body ended early: the connection did
                raise IncompleteReadError(
                    actual_bytes=part.done - before, expected_bytes=end - start
                )

    async def worker() -> None:
        for part in todo:  # shared iterator: each part taken once
            await client.retry("read", key, functools.partial(fetch, part))

    try:
        await gather_or_cancel([worker() for _ in range(min(concurrency, len(parts)))])
    except GaveUp as e:
        if error_code(e.cause)[1] == 404:
            raise await client.not_found("read", key, e) from None
        raise
