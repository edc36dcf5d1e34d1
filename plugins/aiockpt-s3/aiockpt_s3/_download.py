"""Ranged reads: an object's bytes fetched in parts, concurrently, into the caller's buffer."""

from __future__ import annotations

import errno
import functools

from aiockpt.errors import StorageError

from ._client import BucketClient
from ._errors import GaveUp, error_code
from ._transfer import gather_or_cancel


async def download_into(
    client: BucketClient, key: str, offset: int, out: memoryview, part_size: int, concurrency: int
) -> None:
    """Fill ``out`` with the bytes of ``key`` from ``offset`` on: ``part_size`` bytes a GET,
    ``concurrency`` GETs at once, each retried."""
    if not len(out):
        await client.head("read", key)  # nothing to read, but the object must exist
        return
    session = await client.session()
    todo = iter(range(0, len(out), part_size))

    async def fetch(lo: int, hi: int) -> None:
        reply = await session.get_object(
            Bucket=client.bucket, Key=key, Range=f"bytes={offset + lo}-{offset + hi - 1}"
        )
        async with reply["Body"] as body:
            data = await body.read()
        if len(data) != hi - lo:
            raise StorageError(
                f"read {client.where(key)} failed: the object ends before byte {offset + len(out)}",
                path=client.where(key),
                errno=errno.EIO,
            )
        out[lo:hi] = data

    async def worker() -> None:
        for lo in todo:  # shared iterator: each range taken once
            hi = min(lo + part_size, len(out))
            await client.retry("read", key, functools.partial(fetch, lo, hi))

    try:
        await gather_or_cancel(
            [worker() for _ in range(min(concurrency, -(-len(out) // part_size)))]
        )
    except GaveUp as e:
        if error_code(e.cause)[1] == 404:
            raise await client.not_found("read", key, e) from None
        raise
