"""aiockpt's Storage on S3, through the aiobotocore client that s3fs owns.

s3fs gives us credentials, endpoint and client configuration, and its IO event loop (a
dedicated thread); the transfers are ours. Large files go up as multipart uploads whose parts
are sent concurrently straight from the caller's buffers (s3fs's file-like write path sends
parts one at a time). Every request is retried on transient errors with bounded, jittered
backoff; the caller, a plain thread in the daemon, only ever waits on the loop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import errno as errno_mod
import hashlib
import logging
import random
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import crc32c
import fsspec.asyn

# aiohttp is what aiobotocore sends with; its errors can escape botocore's wrapping.
from aiohttp import ClientError as _AiohttpError
from aiohttp.payload import BytesPayload, Payload
from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.parsers import ResponseParserError

from aiockpt.errors import StorageError

__all__ = ["S3Options", "S3Storage", "open_s3"]

log = logging.getLogger("aiockpt")
T = TypeVar("T")

MiB = 1024 * 1024
MIN_PART = 5 * MiB  # S3's minimum for every part but the last
MAX_PART = 5 * 1024 * MiB
MAX_PARTS = 10_000
DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys

#: Error codes S3 (and S3-compatible servers) answer when a retry may succeed.
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "PriorRequestNotComplete",
        "XAmzContentSHA256Mismatch",  # the body was damaged on the way
        "BadDigest",
    }
)


@dataclass(frozen=True, kw_only=True)
class S3Options:
    """The plugin's own ``storage_options``; every other key goes to ``s3fs.S3FileSystem``."""

    #: Bytes per multipart part (S3: 5 MiB to 5 GiB). Raised when a file would need more
    #: than 10,000 parts.
    part_size: int = 16 * MiB
    #: Files of at least this many bytes go up as multipart uploads, smaller ones in one PUT.
    multipart_threshold: int = 16 * MiB
    #: Parts uploaded (and ranges downloaded) at once, per file.
    concurrency: int = 8
    #: Retries of one request after a transient error (throttling, 5xx, connection errors).
    retries: int = 5
    #: First backoff in seconds; doubles each retry, jittered, capped at ``max_backoff``.
    backoff: float = 0.2
    max_backoff: float = 10.0
    #: "crc32c": send each part's and object's CRC32C as S3's additional checksum, so the
    #: server verifies what it stores. "md5": Content-MD5 instead, for servers that do not
    #: take additional checksums. None: send none (bodies are never SHA-256 signed either).
    checksum: str | None = "crc32c"

    def __post_init__(self) -> None:
        def _int(name: str, low: int, high: int | None = None) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"storage option {name!r} must be an int, got {value!r}")
            if value < low or (high is not None and value > high):
                bound = f"between {low} and {high}" if high is not None else f"at least {low}"
                raise ValueError(f"storage option {name!r} must be {bound}, got {value}")

        _int("part_size", MIN_PART, MAX_PART)
        _int("multipart_threshold", 1)
        _int("concurrency", 1, 1024)
        _int("retries", 0, 100)
        for name in ("backoff", "max_backoff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"storage option {name!r} must be a number >= 0, got {value!r}")
        if self.checksum not in ("crc32c", None):
            raise ValueError(
                f"storage option 'checksum' must be 'crc32c' or None, got {self.checksum!r}"
            )

    @classmethod
    def split(cls, options: dict[str, Any]) -> tuple[S3Options, dict[str, Any]]:
        """This plugin's options out of ``options``, and the rest (for s3fs)."""
        names = {f.name for f in dataclasses.fields(cls)}
        ours = {k: v for k, v in options.items() if k in names}
        rest = {k: v for k, v in options.items() if k not in names}
        return cls(**ours), rest


class _ViewPayload(BytesPayload):
    """A request body sent straight from a view of the caller's memory, in slices.

    aiohttp would take a memoryview as it is, but warns on bodies over 1 MiB (one write
    holds the loop) and asyncio may copy what the socket does not take at once; slices
    written one at a time with backpressure bound both. ``__len__`` is botocore's
    Content-Length.
    """

    SLICE = 1024 * 1024

    def __init__(self, view: memoryview) -> None:
        Payload.__init__(self, view, content_type="application/octet-stream")
        self._size = len(view)

    def __len__(self) -> int:
        return self._size

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        view = self._value
        end = self._size if content_length is None else min(content_length, self._size)
        for start in range(0, end, self.SLICE):
            await writer.write(view[start : min(start + self.SLICE, end)])


class _GaveUp(Exception):
    """A request failed for good: not transient, or out of retries."""

    def __init__(self, op: str, key: str, cause: BaseException, attempts: int) -> None:
        super().__init__(op, key)
        self.op, self.key, self.cause, self.attempts = op, key, cause, attempts


def _error_code(e: BaseException) -> tuple[str, int]:
    if isinstance(e, ClientError):
        err = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return str(err.get("Code", "")), int(status)
    return "", 0


def is_transient(e: BaseException) -> bool:
    """Whether a retry of the request that raised ``e`` may succeed."""
    if isinstance(e, ClientError):
        code, status = _error_code(e)
        return code in TRANSIENT_CODES or status >= 500 or status == 429
    return isinstance(
        e,
        (
            HTTPClientError,  # connection reset/closed, read timeouts
            BotoConnectionError,  # connection refused, connect timeouts
            IncompleteReadError,
            ResponseParserError,  # throttling answers are sometimes not XML
            _AiohttpError,
            ConnectionError,
            TimeoutError,
            asyncio.TimeoutError,
        ),
    )


def _os_errno(e: BaseException) -> int | None:
    """The errno of the first OSError in the chain of ``e``."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and isinstance(cur.errno, int):
            return cur.errno
        cur = cur.__cause__ or cur.__context__
    return None


def _b64crc(buf: memoryview | bytes) -> str:
    return base64.b64encode(crc32c.crc32c(buf).to_bytes(4, "big")).decode()


def _b64md5(buf: memoryview | bytes) -> str:
    return base64.b64encode(hashlib.md5(buf).digest()).decode()


def _clear_frames(e: BaseException | None) -> None:
    """Drop the locals of finished frames in ``e``'s chain: they hold views of the caller's
    buffers, which must not outlive the call (shared memory cannot be unmapped under them)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


class S3Storage:
    """A checkpoint root ``s3://bucket/prefix``. Methods are blocking and thread-safe."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import s3fs  # imported here: the entry point module stays cheap to load

        self.url = url
        protocol, sep, rest = url.partition("://")
        if not sep or protocol not in ("s3", "s3a"):
            raise ValueError(f"not an S3 URL: {url!r}")
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {url!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.options, fs_options = S3Options.split(dict(storage_options or {}))
        fs_options["config_kwargs"] = self._client_config(fs_options.get("config_kwargs"))
        # Our own instance: s3fs caches instances by arguments, and we close ours.
        fs_options.setdefault("skip_instance_cache", True)
        if fs_options.get("asynchronous"):
            raise ValueError(
                "storage option 'asynchronous' is not supported: aiockpt owns the loop"
            )
        self.fs = s3fs.S3FileSystem(**fs_options)
        self._pending_aborts: dict[tuple[str, str], None] = {}  # (key, upload id), loop only
        self._closed = False

    def _client_config(self, given: dict[str, Any] | None) -> dict[str, Any]:
        cfg = dict(given or {})
        # Bodies are memoryviews of the caller's buffers; botocore's validator only takes
        # bytes or files, though its serializer and aiohttp send memoryviews as they are.
        cfg["parameter_validation"] = False
        # We retry ourselves (bounded, with backoff); botocore's retries would multiply ours.
        cfg.setdefault("retries", {"total_max_attempts": 1})
        cfg.setdefault("max_pool_connections", max(10, 2 * self.options.concurrency))
        # botocore would otherwise compute its own CRC32 over every body we send.
        cfg.setdefault("request_checksum_calculation", "when_required")
        # Bodies are sent from memory as they are and never SHA-256 hashed for the signature:
        # the checksum we send guards them (botocore makes the same choice over HTTPS).
        s3 = dict(cfg.get("s3") or {})
        if s3.get("payload_signing_enabled"):
            raise ValueError("aiockpt's S3 storage does not sign payloads; use 'checksum'")
        s3["payload_signing_enabled"] = False
        cfg["s3"] = s3
        return cfg

    # ----------------------------------------------------------------- plumbing

    def _key(self, path: str) -> str:
        path = path.strip("/")
        if self.prefix and path:
            return f"{self.prefix}/{path}"
        return self.prefix or path

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _run(self, op: str, path: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run a coroutine on s3fs's loop thread; any failure becomes a StorageError."""
        if self._closed:
            raise StorageError(f"{op} {self._where(self._key(path))}: the storage is closed")
        try:
            return fsspec.asyn.sync(self.fs.loop, fn, *args)
        except StorageError:
            raise
        except _GaveUp as e:
            err = self._error(e.op, e.key, e.cause, e.attempts)
            _clear_frames(e)
            raise err from None
        except Exception as e:
            err = self._error(op, self._key(path), e, 1)
            _clear_frames(e)
            raise err from None

    def _error(self, op: str, key: str, e: BaseException, attempts: int) -> StorageError:
        where = self._where(key)
        code, status = _error_code(e)
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        if code == "NoSuchBucket":
            msg, num = f"the bucket {self.bucket!r} does not exist", errno_mod.ENOENT
        elif code in ("NoSuchKey", "404", "NotFound") or status == 404:
            msg, num = "no such object", errno_mod.ENOENT
        elif code in ("AccessDenied", "403", "Forbidden") or status == 403:
            msg, num = f"access denied ({e})", errno_mod.EACCES
        elif code == "InvalidRange":
            msg, num = "the object ends before the requested range", errno_mod.EIO
        elif code in ("NotImplemented", "InvalidArgument", "InvalidRequest") and "hecksum" in str(
            e
        ):
            msg = (
                f"the server refused the request ({e}); if it does not accept S3's additional "
                "checksums, pass storage_options={'checksum': None}"
            )
            num = errno_mod.EINVAL
        elif isinstance(e, StorageError):
            return StorageError(str(e), path=where, errno=e.errno)
        else:
            num = _os_errno(e)
            if num is None:
                num = errno_mod.ETIMEDOUT if isinstance(e, TimeoutError) else errno_mod.EIO
            msg = f"{type(e).__name__}: {e}"
        err = StorageError(f"{op} {where} failed{tries}: {msg}", path=where, errno=num)
        err.__cause__ = e
        return err

    def _backoff(self, attempt: int) -> float:
        cap = min(self.options.max_backoff, self.options.backoff * (2**attempt))
        return cap / 2 + random.uniform(0, cap / 2)  # equal jitter: spread the retries out

    async def _retry(self, op: str, key: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn()`` with retries on transient errors; raises _GaveUp at the end."""
        attempt = 0
        while True:
            try:
                return await fn()
            except Exception as e:
                if attempt >= self.options.retries or not is_transient(e):
                    raise _GaveUp(op, key, e, attempt + 1) from e
                log.debug("%s %s: %s; retry %d", op, self._where(key), e, attempt + 1)
            await asyncio.sleep(self._backoff(attempt))
            attempt += 1

    async def _call(self, op: str, key: str, method: str, **kwargs: Any) -> dict[str, Any]:
        client = await self.fs.set_session()
        call = getattr(client, method)
        return await self._retry(op, key, lambda: call(Bucket=self.bucket, **kwargs))

    async def _not_found(self, op: str, key: str, e: _GaveUp) -> _GaveUp:
        """A 404 without a code: tell a missing bucket from a missing object."""
        client = await self.fs.set_session()
        try:
            await self._retry(op, key, lambda: client.head_bucket(Bucket=self.bucket))
        except _GaveUp as b:
            if _error_code(b.cause)[1] == 404:
                fake = ClientError({"Error": {"Code": "NoSuchBucket"}}, "HeadBucket")
                return _GaveUp(op, key, fake, 1)
        return e

    # ----------------------------------------------------------------- writes

    def write_file(self, path: str, buffers: Sequence[memoryview]) -> None:
        self._run("write", path, self._write, self._key(path), buffers)

    async def _write(self, key: str, buffers: Sequence[memoryview]) -> None:
        await self._flush_aborts()
        views = [memoryview(b).cast("B") for b in buffers]
        try:
            total = sum(len(v) for v in views)
            if total < self.options.multipart_threshold:
                body: memoryview | bytes = views[0] if len(views) == 1 else b"".join(views)
                await self._put(key, body)
            else:
                await self._multipart(key, views, total)
        finally:
            for v in views:
                v.release()

    async def _put(self, key: str, body: memoryview | bytes) -> None:
        kwargs: dict[str, Any] = {"Key": key}
        kwargs.update(await self._checksum(body))
        kwargs["Body"] = _ViewPayload(memoryview(body)) if len(body) else b""
        await self._call("write", key, "put_object", **kwargs)

    async def _checksum(self, body: memoryview | bytes) -> dict[str, str]:
        """The checksum parameters of a request sending ``body``."""
        if self.options.checksum is None:
            return {}
        # Both release the GIL: off the loop thread, parts are checksummed in parallel.
        fn = _b64crc if self.options.checksum == "crc32c" else _b64md5
        value = await asyncio.get_running_loop().run_in_executor(None, fn, body)
        name = "ChecksumCRC32C" if self.options.checksum == "crc32c" else "ContentMD5"
        return {name: value}

    def _plan(self, total: int) -> list[tuple[int, int]]:
        size = max(self.options.part_size, -(-total // MAX_PARTS))
        return [(start, min(start + size, total)) for start in range(0, total, size)]

    @staticmethod
    def _slice(views: list[memoryview], start: int, stop: int) -> memoryview | bytes:
        """Bytes [start, stop) of the concatenation: a view, or a copy only across buffers."""
        pieces = []
        base = 0
        for v in views:
            lo, hi = max(start, base), min(stop, base + len(v))
            if lo < hi:
                pieces.append(v[lo - base : hi - base])
            base += len(v)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def _multipart(self, key: str, views: list[memoryview], total: int) -> None:
        create: dict[str, Any] = {"Key": key}
        if self.options.checksum == "crc32c":
            create["ChecksumAlgorithm"] = "CRC32C"
        upload_id = (await self._call("write", key, "create_multipart_upload", **create))[
            "UploadId"
        ]
        try:
            plan = self._plan(total)
            done: dict[int, dict[str, Any]] = {}
            todo = iter(enumerate(plan, start=1))

            async def worker() -> None:
                for number, (start, stop) in todo:  # shared iterator: each part taken once
                    done[number] = await self._part(key, upload_id, number, views, start, stop)

            await _gather_or_cancel(
                [worker() for _ in range(min(self.options.concurrency, len(plan)))]
            )
            parts = [done[n] for n in sorted(done)]
            await self._complete(key, upload_id, parts, total)
        except BaseException:
            # Shielded: the parts must go even when the save is being cancelled.
            await asyncio.shield(self._abort(key, upload_id))
            raise

    async def _part(
        self, key: str, upload_id: str, number: int, views: list[memoryview], start: int, stop: int
    ) -> dict[str, Any]:
        body = self._slice(views, start, stop)
        kwargs: dict[str, Any] = {"Key": key, "UploadId": upload_id, "PartNumber": number}
        part: dict[str, Any] = {"PartNumber": number}
        checksum = await self._checksum(body)
        kwargs.update(checksum)
        if "ChecksumCRC32C" in checksum:
            part["ChecksumCRC32C"] = checksum["ChecksumCRC32C"]
            kwargs["ChecksumAlgorithm"] = "CRC32C"
        kwargs["Body"] = _ViewPayload(memoryview(body))
        try:
            reply = await self._call("write", key, "upload_part", **kwargs)
        finally:
            del body, kwargs  # no view of the caller's buffers outlives the request
        part["ETag"] = reply["ETag"]
        return part

    async def _complete(
        self, key: str, upload_id: str, parts: list[dict[str, Any]], total: int
    ) -> None:
        client = await self.fs.set_session()
        attempts = 0

        async def complete() -> dict[str, Any]:
            nonlocal attempts
            attempts += 1
            try:
                return await client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except ClientError as e:
                # A retry after a completion whose answer was lost finds the upload gone.
                if attempts > 1 and _error_code(e)[0] == "NoSuchUpload":
                    head = await client.head_object(Bucket=self.bucket, Key=key)
                    if head.get("ContentLength") == total:
                        return {}
                raise

        await self._retry("write", key, complete)

    async def _abort(self, key: str, upload_id: str) -> None:
        """Abort a multipart upload; one that cannot be aborted now is retried later."""
        try:
            await self._call(
                "abort upload of", key, "abort_multipart_upload", Key=key, UploadId=upload_id
            )
        except _GaveUp as e:
            if _error_code(e.cause)[0] == "NoSuchUpload":
                return
            self._pending_aborts[(key, upload_id)] = None
            log.warning(
                "could not abort multipart upload %s of %s (%s); retrying at the next "
                "write, delete or close",
                upload_id,
                self._where(key),
                e.cause,
            )

    async def _flush_aborts(self) -> None:
        for key, upload_id in list(self._pending_aborts):
            del self._pending_aborts[(key, upload_id)]
            await self._abort(key, upload_id)  # puts it back if it fails again

    def put_atomic(self, path: str, data: bytes) -> None:
        # One PUT: S3 shows readers all of an object or none of it.
        self._run("write", path, self._put, self._key(path), bytes(data))

    def makedirs(self, path: str) -> None:
        """S3 has no directories; this never calls s3fs's makedirs (which creates buckets)."""

    def delete(self, path: str, *, recursive: bool = False) -> None:
        self._run("delete", path, self._delete, self._key(path), recursive)

    async def _delete(self, key: str, recursive: bool) -> None:
        await self._flush_aborts()
        if not recursive:
            await self._call("delete", key, "delete_object", Key=key)
            return
        keys = [key, *[k async for k in self._keys_under(key + "/" if key else "")]]
        for i in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": k} for k in keys[i : i + DELETE_BATCH] if k]
            if not batch:
                continue
            reply = await self._call(
                "delete", key, "delete_objects", Delete={"Objects": batch, "Quiet": True}
            )
            errors = reply.get("Errors") or []
            if errors:
                first = errors[0]
                raise _GaveUp(
                    "delete",
                    first.get("Key", key),
                    ClientError({"Error": first}, "DeleteObjects"),
                    1,
                )
        # Uploads still open under the prefix (a save that died) are part of what goes.
        prefix = key + "/" if key else ""
        async for upload_key, upload_id in self._uploads_under(prefix):
            await self._abort(upload_key, upload_id)

    async def _keys_under(self, prefix: str):  # -> AsyncIterator[str]
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            reply = await self._call("list", prefix, "list_objects_v2", **kwargs)
            for obj in reply.get("Contents") or []:
                yield obj["Key"]
            token = reply.get("NextContinuationToken")
            if not reply.get("IsTruncated") or not token:
                return

    async def _uploads_under(self, prefix: str):  # -> AsyncIterator[tuple[str, str]]
        markers: dict[str, str] = {}
        while True:
            reply = await self._call(
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

    def pending_aborts(self) -> list[tuple[str, str]]:
        """Multipart uploads (key, upload id) that failed to abort and will be retried."""
        return list(self._pending_aborts)

    # ----------------------------------------------------------------- reads

    def read_range(self, path: str, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"bad byte range [{start}, {end})")
        out = bytearray(end - start)
        self.readinto(path, start, memoryview(out))
        return bytes(out)

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        try:
            self._run("read", path, self._readinto, self._key(path), offset, view)
        finally:
            view.release()

    async def _readinto(self, key: str, offset: int, out: memoryview) -> None:
        if not len(out):
            await self._head(key, "read")  # nothing to read, but the object must exist
            return
        client = await self.fs.set_session()
        step = self.options.part_size
        todo = iter(range(0, len(out), step))

        async def fetch(lo: int, hi: int) -> None:
            reply = await client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={offset + lo}-{offset + hi - 1}"
            )
            async with reply["Body"] as body:
                data = await body.read()
            if len(data) != hi - lo:
                raise StorageError(
                    f"read {self._where(key)} failed: "
                    f"the object ends before byte {offset + len(out)}",
                    path=self._where(key),
                    errno=errno_mod.EIO,
                )
            out[lo:hi] = data

        async def worker() -> None:
            for lo in todo:
                hi = min(lo + step, len(out))
                await self._retry("read", key, lambda lo=lo, hi=hi: fetch(lo, hi))

        try:
            await _gather_or_cancel(
                [worker() for _ in range(min(self.options.concurrency, -(-len(out) // step)))]
            )
        except _GaveUp as e:
            if _error_code(e.cause)[1] == 404:
                raise await self._not_found("read", key, e) from None
            raise

    async def _head(self, key: str, op: str) -> dict[str, Any]:
        try:
            return await self._call(op, key, "head_object", Key=key)
        except _GaveUp as e:
            if _error_code(e.cause)[1] == 404:
                raise await self._not_found(op, key, e) from None
            raise

    def size(self, path: str) -> int:
        return self._run("stat", path, self._size, self._key(path))

    async def _size(self, key: str) -> int:
        return int((await self._head(key, "stat"))["ContentLength"])

    def exists(self, path: str) -> bool:
        return self._run("stat", path, self._exists, self._key(path))

    async def _exists(self, key: str) -> bool:
        if key:
            try:
                await self._call("stat", key, "head_object", Key=key)
                return True
            except _GaveUp as e:
                if _error_code(e.cause)[1] != 404:
                    raise
        # Not an object: a "directory" exists when something lies under it. This listing
        # also turns a missing bucket into NoSuchBucket rather than a bare 404.
        prefix = key + "/" if key else ""
        reply = await self._call("stat", key, "list_objects_v2", Prefix=prefix, MaxKeys=1)
        return bool(reply.get("KeyCount") or reply.get("Contents"))

    def list_dir(self, path: str) -> list[str]:
        # Always a fresh listing: we never use s3fs's listing cache, and another process
        # (another rank's daemon) may have written since.
        return self._run("list", path, self._list_dir, self._key(path))

    async def _list_dir(self, key: str) -> list[str]:
        prefix = key + "/" if key else ""
        names: set[str] = set()
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix, "Delimiter": "/"}
            if token:
                kwargs["ContinuationToken"] = token
            reply = await self._call("list", key, "list_objects_v2", **kwargs)
            for p in reply.get("CommonPrefixes") or []:
                names.add(p["Prefix"][len(prefix) :].rstrip("/"))
            for obj in reply.get("Contents") or []:
                names.add(obj["Key"][len(prefix) :])
            token = reply.get("NextContinuationToken")
            if not reply.get("IsTruncated") or not token:
                break
        names.discard("")
        return sorted(names)

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Retry aborts that failed earlier, then close the HTTP client."""
        if self._closed:
            return
        try:
            fsspec.asyn.sync(self.fs.loop, self._flush_aborts)
        except Exception as e:  # close must not fail; what is left is logged
            log.warning("closing %s: %s", self.url, e)
        for key, upload_id in self._pending_aborts:
            log.warning(
                "multipart upload %s of %s could not be aborted; its parts remain until a "
                "bucket lifecycle rule (AbortIncompleteMultipartUpload) removes them",
                upload_id,
                self._where(key),
            )
        self._closed = True
        creator = getattr(self.fs, "_s3creator", None)
        if creator is not None and getattr(self.fs, "_s3", None) is not None:
            with contextlib.suppress(Exception):
                fsspec.asyn.sync(self.fs.loop, creator.__aexit__, None, None, None, timeout=10)
            self.fs._s3 = None


async def _gather_or_cancel(coros: list[Awaitable[None]]) -> None:
    """Run ``coros`` together; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]


def open_s3(url: str, storage_options: dict[str, Any]) -> S3Storage:
    """The ``aiockpt.storage`` entry point for ``s3://`` and ``s3a://``."""
    return S3Storage(url, storage_options)
