"""Requests to one bucket over gcsfs's aiohttp session and credentials: bounded retries with
jittered backoff, bodies streamed from the caller's memory, and what a failure means."""

from __future__ import annotations

import asyncio
import base64
import errno as errno_mod
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple
from urllib.parse import quote

import aiohttp
import crc32c
from aiohttp.payload import BytesPayload, Payload

from aiockpt.errors import StorageError
from aiockpt.storage.objects import Retrier, clear_frames, failed

from ._options import GCSOptions

#: The custom metadata key holding a create's own token.
TOKEN_KEY = "aiockpt-write"


def write_token() -> dict[str, str]:
    """The metadata a create puts on its object: a token no other write has, by which a
    create that meets 412 tells its own object (an earlier try whose answer was lost) from
    another writer's."""
    return {TOKEN_KEY: uuid.uuid4().hex}


def exists_error(where: str) -> StorageError:
    """The failure of a write onto an object that is there already (``errno.EEXIST``)."""
    return StorageError(
        f"create {where} failed: an object is there already (a write never replaces one)",
        path=where,
        errno=errno_mod.EEXIST,
    )


#: HTTP statuses after which a retry of the same request may succeed.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RequestFailed(Exception):
    """GCS answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


def status_of(e: BaseException) -> int:
    """The HTTP status GCS answered, 0 when it did not answer."""
    return e.status if isinstance(e, RequestFailed) else 0


def is_transient(e: BaseException) -> bool:
    """Whether a retry of the request that raised ``e`` may succeed."""
    if isinstance(e, RequestFailed):
        return e.status in TRANSIENT_STATUS
    return isinstance(
        e,
        (aiohttp.ClientError, ConnectionError, TimeoutError, asyncio.TimeoutError),
    )


class Reply(NamedTuple):
    status: int
    headers: Mapping[str, str]
    body: bytes
    received: int  # bytes written into the caller's view, for a read into one


class ViewsPayload(BytesPayload):
    """A request body sent straight from views of the caller's memory, in 1 MiB slices, never
    joined into one buffer (asyncio may copy a large write the socket does not take at once)."""

    SLICE = 1024 * 1024
    _size: int

    def __init__(self, views: Sequence[memoryview | bytes], content_type: str) -> None:
        self._views = tuple(views)
        Payload.__init__(self, self._views, content_type=content_type)
        self._size = sum(len(v) for v in views)
        self._writers: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return self._size

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return f"<{self._size} bytes>"

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"".join(self._views)

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def settle(self) -> None:
        """End the tasks still sending this body (aiohttp may leave its writer task running
        after a failed request): each holds a view of the caller's memory until it ends."""
        me = asyncio.current_task()
        tasks = [t for t in self._writers if t is not me and not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._writers.clear()

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._writers.add(task)
        left = self._size if content_length is None else min(content_length, self._size)
        views = self._views
        view: memoryview | bytes | None = None
        piece: memoryview | bytes | None = None
        try:
            for view in views:
                for start in range(0, len(view), self.SLICE):
                    if left <= 0:
                        return
                    piece = view[start : start + min(self.SLICE, left)]
                    left -= len(piece)
                    await writer.write(piece)
        except BaseException as e:
            clear_frames(e)  # the frames it went through hold slices of the caller's memory
            raise
        finally:
            views, view, piece = (), None, None  # and this one's, kept by a traceback through it


def crc32c_b64(views: Sequence[memoryview | bytes]) -> str:
    """The CRC32C of the concatenation, as GCS writes it (base64 of the big-endian value)."""
    value = 0
    for v in views:
        value = crc32c.crc32c(v, value)
    return as_b64(value)


def as_b64(crc: int) -> str:
    """A CRC32C as GCS writes it: base64 of the big-endian value."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def _message(body: bytes) -> str:
    try:
        err = json.loads(body)["error"]
        return str(err["message"] if isinstance(err, dict) else err)
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace") or "(no message)"


class BucketClient:
    """Requests to ``bucket`` through the session and credentials of a GCSFileSystem."""

    def __init__(self, fs: Any, bucket: str, options: GCSOptions) -> None:
        self.fs = fs
        self.bucket = bucket
        self.options = options
        location = fs._location.rstrip("/")
        self.objects = f"{location}/storage/v1/b/{quote(bucket, safe='')}/o"
        self.uploads = f"{location}/upload/storage/v1/b/{quote(bucket, safe='')}/o"
        self.retrier = Retrier(options, transient=is_transient, where=self.where)
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=options.connect_timeout, sock_read=options.read_timeout
        )

    def where(self, key: str) -> str:
        return f"gs://{self.bucket}/{key}"

    def object_url(self, key: str) -> str:
        return f"{self.objects}/{quote(key, safe='')}"

    async def call(
        self,
        op: str,
        key: str,
        method: str,
        url: str,
        *,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        body: Callable[[], Any] | None = None,
        into: memoryview | None = None,
    ) -> Reply:
        """One request, retried; ``body()`` makes its body afresh for each try, ``into``
        receives the answer's bytes."""
        return await self.retrier.run(
            op, key, lambda: self._once(method, url, params, headers, body, into)
        )

    async def _once(
        self,
        method: str,
        url: str,
        params: dict[str, str] | None,
        headers: dict[str, str] | None,
        body: Callable[[], Any] | None,
        into: memoryview | None,
    ) -> Reply:
        payload = body() if body is not None else None
        try:
            return await self._send(method, url, params, headers, payload, into)
        finally:
            if isinstance(payload, ViewsPayload):
                await payload.settle()

    async def _send(
        self,
        method: str,
        url: str,
        params: dict[str, str] | None,
        headers: dict[str, str] | None,
        payload: Any,
        into: memoryview | None,
    ) -> Reply:
        session = await self.fs._set_session()
        async with session.request(
            method,
            url,
            params=self.fs._get_params(dict(params or {})),
            headers=self.fs._get_headers(headers),
            data=payload,
            timeout=self._timeout,
        ) as r:
            if r.status >= 300:
                raise RequestFailed(r.status, _message(await r.read()))
            if into is None:
                return Reply(r.status, r.headers, await r.read(), 0)
            n = 0
            async for chunk in r.content.iter_chunked(1024 * 1024):
                if n + len(chunk) > len(into):
                    raise RequestFailed(r.status, "the answer is longer than the range asked")
                into[n : n + len(chunk)] = chunk
                n += len(chunk)
            return Reply(r.status, r.headers, b"", n)


def storage_error(
    op: str, where: str, bucket: str, e: BaseException, attempts: int
) -> StorageError:
    """The StorageError that tells the caller ``op`` on ``where`` failed because of ``e``."""
    status = status_of(e)
    reason: tuple[str, int] | None = None
    if status == 404 and op in ("write", "create", "list"):
        reason = f"the bucket {bucket!r} does not exist", errno_mod.ENOENT
    elif status == 404:
        reason = "no such object", errno_mod.ENOENT
    elif status in (401, 403):
        reason = f"access denied ({e})", errno_mod.EACCES
    elif status == 416:
        reason = "the object ends before the requested range", errno_mod.EIO
    return failed(op, where, e, attempts, reason)
