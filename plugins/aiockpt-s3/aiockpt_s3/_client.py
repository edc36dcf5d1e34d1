"""Requests to one bucket through s3fs's aiobotocore client, each retried on transient errors."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from aiockpt.storage.objects import GaveUp, Retrier

from ._errors import error_code, is_transient, no_such_bucket
from ._options import S3Options

T = TypeVar("T")

#: The user metadata key (``x-amz-meta-aiockpt-write``) holding a create's own token.
TOKEN_KEY = "aiockpt-write"


def write_token() -> dict[str, str]:
    """The metadata a create puts on its object: a token no other write has, by which a
    create that meets 412 tells its own object (an earlier try whose answer was lost) from
    another writer's."""
    return {TOKEN_KEY: uuid.uuid4().hex}


class BucketClient:
    """The bucket ``bucket`` on the client of ``fs``. Coroutines: they run on s3fs's loop.

    A request that fails for good, not transient or out of the retries ``options`` allow,
    raises GaveUp.
    """

    def __init__(self, fs: Any, bucket: str, options: S3Options) -> None:
        self.fs = fs
        self.bucket = bucket
        self.retrier = Retrier(options, transient=is_transient, where=self.where)

    def where(self, key: str) -> str:
        """The URL of ``key``, for messages."""
        return f"s3://{self.bucket}/{key}"

    async def session(self) -> Any:
        """s3fs's aiobotocore client, created on first use."""
        return await self.fs.set_session()

    async def retry(self, op: str, key: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn()``, retried on transient errors; GaveUp names ``op`` and ``key``."""
        return await self.retrier.run(op, key, fn)

    async def call(self, op: str, key: str, method: str, **kwargs: Any) -> dict[str, Any]:
        """The client's ``method`` on this bucket, retried."""
        client = await self.session()
        call = getattr(client, method)
        return await self.retry(op, key, lambda: call(Bucket=self.bucket, **kwargs))

    async def head(self, op: str, key: str) -> dict[str, Any]:
        """HeadObject of ``key``; a missing bucket fails as such, not as a missing object."""
        try:
            return await self.call(op, key, "head_object", Key=key)
        except GaveUp as e:
            if error_code(e.cause)[1] == 404:
                raise await self.not_found(op, key, e) from None
            raise

    async def holds(self, key: str, token: dict[str, str]) -> bool:
        """Whether the object ``key`` carries the create token ``token``."""
        head = await self.call("write", key, "head_object", Key=key)
        return bool((head.get("Metadata") or {}).get(TOKEN_KEY) == token[TOKEN_KEY])

    async def not_found(self, op: str, key: str, e: GaveUp) -> GaveUp:
        """A 404 without a code: tell a missing bucket from a missing object."""
        try:
            await self.call(op, key, "head_bucket")
        except GaveUp as b:
            if error_code(b.cause)[1] == 404:
                return no_such_bucket(op, key)
        return e

    async def listing(self, op: str, key: str, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """The pages of ListObjectsV2 with ``kwargs``, all of them."""
        token: str | None = None
        while True:
            page = dict(kwargs)
            if token:
                page["ContinuationToken"] = token
            reply = await self.call(op, key, "list_objects_v2", **page)
            yield reply
            token = reply.get("NextContinuationToken")
            if not reply.get("IsTruncated") or not token:
                return

    async def keys_under(self, prefix: str) -> AsyncIterator[str]:
        """Every key that starts with ``prefix``."""
        async for reply in self.listing("list", prefix, Prefix=prefix):
            for obj in reply.get("Contents") or []:
                yield obj["Key"]

    async def uploads_under(self, prefix: str) -> AsyncIterator[tuple[str, str]]:
        """(key, upload id) of every multipart upload still open under ``prefix``."""
        markers: dict[str, str] = {}
        while True:
            reply = await self.call(
                "list uploads of", prefix, "list_multipart_uploads", Prefix=prefix, **markers
            )
            for up in reply.get("Uploads") or []:
                yield up["Key"], up["UploadId"]
            if not reply.get("IsTruncated"):
                return
            markers = {
                "KeyMarker": reply.get("NextKeyMarker", ""),
                "UploadIdMarker": reply.get("NextUploadIdMarker", ""),
            }
