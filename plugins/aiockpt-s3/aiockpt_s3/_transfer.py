"""Moving bytes: request bodies sent from the caller's memory, their checksums, and several
requests at once."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import crc32c
from aiohttp.payload import BytesPayload, Payload


class ViewPayload(BytesPayload):
    """A request body sent straight from a view of the caller's memory, in slices.

    aiohttp would take a memoryview as it is, but warns on bodies over 1 MiB (one write
    holds the loop) and asyncio may copy what the socket does not take at once; slices
    written one at a time with backpressure bound both. ``__len__`` is botocore's
    Content-Length.
    """

    SLICE = 1024 * 1024
    _size: int  # aiohttp's own size attribute, always known here

    def __init__(self, view: memoryview) -> None:
        Payload.__init__(self, view, content_type="application/octet-stream")
        self._size = len(view)

    def __len__(self) -> int:
        return self._size

    async def write(self, writer: Any) -> None:
        """Send the whole body."""
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        """Send the body, or its first ``content_length`` bytes."""
        view = self._value
        end = self._size if content_length is None else min(content_length, self._size)
        for start in range(0, end, self.SLICE):
            await writer.write(view[start : min(start + self.SLICE, end)])


def _b64crc(buf: memoryview | bytes) -> str:
    return base64.b64encode(crc32c.crc32c(buf).to_bytes(4, "big")).decode()


async def checksum_params(checksum: str | None, body: memoryview | bytes) -> dict[str, str]:
    """The checksum parameters of a request sending ``body`` (``checksum``: S3Options')."""
    if checksum is None:
        return {}
    # crc32c releases the GIL: off the loop thread, parts are checksummed in parallel.
    value = await asyncio.get_running_loop().run_in_executor(None, _b64crc, body)
    return {"ChecksumCRC32C": value}
