"""Multipart uploads: parts sent concurrently from the caller's buffers, each with its
checksum, and aborted when the upload fails (again later when the abort itself fails)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from botocore.exceptions import ClientError

from aiockpt.storage.objects import GaveUp, gather_or_cancel

from ._client import BucketClient, write_token
from ._errors import error_code, exists_error, is_precondition_failed
from ._options import MAX_PARTS, S3Options
from ._transfer import ViewPayload, checksum_params

log = logging.getLogger("aiockpt")


def plan(total: int, part_size: int) -> list[tuple[int, int]]:
    """The byte ranges [start, stop) of the parts of ``total`` bytes: at most MAX_PARTS."""
    size = max(part_size, -(-total // MAX_PARTS))
    return [(start, min(start + size, total)) for start in range(0, total, size)]


def byte_slice(views: list[memoryview], start: int, stop: int) -> memoryview | bytes:
    """Bytes [start, stop) of the concatenation: a view, or a copy only across buffers."""
    pieces = []
    base = 0
    for v in views:
        lo, hi = max(start, base), min(stop, base + len(v))
        if lo < hi:
            pieces.append(v[lo - base : hi - base])
        base += len(v)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class MultipartUploader:
    """Writes large objects to ``client``'s bucket as multipart uploads.

    Uploads that could not be aborted are kept (touched on the loop only) and aborted again
    by ``flush_aborts``.
    """

    def __init__(self, client: BucketClient, options: S3Options) -> None:
        self.client = client
        self.options = options
        self.pending_aborts: dict[tuple[str, str], None] = {}  # (key, upload id), in order
        self.tokens: dict[str, dict[str, str]] = {}  # upload id: the create token it carries

    async def create(self, key: str) -> str:
        """Start a multipart upload of ``key``; its id."""
        token = write_token()
        create: dict[str, Any] = {"Key": key, "Metadata": token}
        if self.options.checksum == "crc32c":
            create["ChecksumAlgorithm"] = "CRC32C"
        reply = await self.client.call("write", key, "create_multipart_upload", **create)
        upload_id = str(reply["UploadId"])
        self.tokens[upload_id] = token
        return upload_id

    async def part(self, key: str, upload_id: str, number: int, body: bytes) -> dict[str, Any]:
        """Send part ``number`` of an upload from ``body``: its entry for the completion."""
        return await self._part(key, upload_id, number, [memoryview(body)], 0, len(body))

    async def complete(
        self, key: str, upload_id: str, parts: list[dict[str, Any]], total: int
    ) -> None:
        """Complete an upload of ``total`` bytes from its ``parts``, in order."""
        await self._complete(key, upload_id, parts, total)

    async def upload(self, key: str, views: list[memoryview], total: int) -> None:
        """Write the concatenation of ``views``, ``total`` bytes, to ``key``."""
        upload_id = await self.create(key)
        try:
            ranges = plan(total, self.options.part_size)
            done: dict[int, dict[str, Any]] = {}
            todo = iter(enumerate(ranges, start=1))

            async def worker() -> None:
                for number, (start, stop) in todo:  # shared iterator: each part taken once
                    done[number] = await self._part(key, upload_id, number, views, start, stop)

            await gather_or_cancel(
                [worker() for _ in range(min(self.options.concurrency, len(ranges)))]
            )
            parts = [done[n] for n in sorted(done)]
            await self._complete(key, upload_id, parts, total)
        except BaseException:
            # Shielded: the parts must go even when the save is being cancelled.
            await asyncio.shield(self.abort(key, upload_id))
            raise

    async def _part(
        self, key: str, upload_id: str, number: int, views: list[memoryview], start: int, stop: int
    ) -> dict[str, Any]:
        body = byte_slice(views, start, stop)
        kwargs: dict[str, Any] = {"Key": key, "UploadId": upload_id, "PartNumber": number}
        part: dict[str, Any] = {"PartNumber": number}
        checksum = await checksum_params(self.options.checksum, body)
        kwargs.update(checksum)
        if "ChecksumCRC32C" in checksum:
            part["ChecksumCRC32C"] = checksum["ChecksumCRC32C"]
            kwargs["ChecksumAlgorithm"] = "CRC32C"
        kwargs["Body"] = ViewPayload(memoryview(body))
        try:
            reply = await self.client.call("write", key, "upload_part", **kwargs)
        finally:
            del body, kwargs  # no view of the caller's buffers outlives the request
        part["ETag"] = reply["ETag"]
        return part

    async def _complete(
        self, key: str, upload_id: str, parts: list[dict[str, Any]], total: int
    ) -> None:
        """Complete the upload with ``If-None-Match: *``: S3 makes the object only where none
        is, and answers 412 otherwise, an EEXIST that is not retried (the caller aborts the
        upload). A completion that meets 412, or a retried one that finds the upload gone,
        may have met its own earlier try whose answer was lost: the object is ours when it
        carries the token the upload was created with."""
        client = await self.client.session()
        bucket = self.client.bucket
        token = self.tokens.pop(upload_id, None)
        attempts = 0

        async def complete() -> dict[str, Any]:
            nonlocal attempts
            attempts += 1
            try:
                return await client.complete_multipart_upload(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    IfNoneMatch="*",
                )
            except ClientError as e:
                # 412 may be this upload's own object, completed by a try whose answer was
                # lost; so may a vanished upload on a retry. The token it carries tells.
                maybe_ours = is_precondition_failed(e) or (
                    attempts > 1 and error_code(e)[0] == "NoSuchUpload"
                )
                if maybe_ours and token is not None and await self.client.holds(key, token):
                    return {}
                if is_precondition_failed(e):
                    raise exists_error(self.client.where(key)) from None
                raise

        await self.client.retry("write", key, complete)

    async def abort(self, key: str, upload_id: str) -> None:
        """Abort a multipart upload; one that cannot be aborted now is retried later."""
        self.tokens.pop(upload_id, None)
        try:
            await self.client.call(
                "abort upload of", key, "abort_multipart_upload", Key=key, UploadId=upload_id
            )
        except GaveUp as e:
            if error_code(e.cause)[0] == "NoSuchUpload":
                return
            self.pending_aborts[(key, upload_id)] = None
            log.warning(
                "could not abort multipart upload %s of %s (%s); retrying at the next "
                "write, delete or close",
                upload_id,
                self.client.where(key),
                e.cause,
            )

    async def flush_aborts(self) -> None:
        """Abort again every upload whose abort failed."""
        for key, upload_id in list(self.pending_aborts):
            del self.pending_aborts[(key, upload_id)]
            await self.abort(key, upload_id)  # puts it back if it fails again
