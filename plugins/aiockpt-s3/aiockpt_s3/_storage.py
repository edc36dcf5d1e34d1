"""aiockpt's Storage on S3, through the aiobotocore client that s3fs owns.

s3fs gives us credentials, endpoint and client configuration, and its IO event loop (a
dedicated thread); the transfers are ours. Large files go up as multipart uploads whose parts
are sent concurrently straight from the caller's buffers (s3fs's file-like write path sends
parts one at a time); large reads come down as ranged GETs run concurrently, each streamed
straight into its slice of the caller's buffer. Every request is retried on transient errors
with bounded, jittered backoff; the caller, a plain thread in the daemon, only ever waits on
the loop.

The pieces: ``_options`` (S3Options), ``_errors`` (what failures mean), ``_retry`` (the
retries), ``_client`` (requests to the bucket), ``_transfer`` (bodies and checksums),
``_multipart`` (large writes) and ``_download`` (reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import fsspec.asyn
from botocore.exceptions import ClientError

from aiockpt.errors import StorageError
from aiockpt.storage.objects import GaveUp, key_under, run_sync, storage_errors

from ._client import BucketClient, write_token
from ._download import download_into
from ._errors import error_code, exists_error, is_precondition_failed, storage_error
from ._multipart import MultipartUploader
from ._options import S3Options
from ._stream import write_stream
from ._transfer import ViewPayload, checksum_params

__all__ = ["S3Options", "S3Storage", "open_s3"]

log = logging.getLogger("aiockpt")
T = TypeVar("T")

DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys
#: Tries of a conditional PUT that S3 answers 409 (another conditional PUT of the key running).
_CONFLICT_TRIES = 20


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
        self._client = BucketClient(self.fs, bucket, self.options)
        self._uploads = MultipartUploader(self._client, self.options)
        self._closed = False

    def _client_config(self, given: dict[str, Any] | None) -> dict[str, Any]:
        cfg = dict(given or {})
        # Bodies are memoryviews of the caller's buffers; botocore's validator only takes
        # bytes or files, though its serializer and aiohttp send memoryviews as they are.
        cfg["parameter_validation"] = False
        # We retry ourselves (bounded, with backoff); botocore's retries would multiply ours.
        cfg.setdefault("retries", {"total_max_attempts": 1})
        most = max(self.options.concurrency, self.options.read_concurrency)
        cfg.setdefault("max_pool_connections", max(10, 2 * most))
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
        return key_under(self.prefix, path)

    def _run(self, op: str, path: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run a coroutine on s3fs's loop thread; any failure becomes a StorageError."""
        key = self._key(path)
        if self._closed:
            raise StorageError(f"{op} {self._client.where(key)}: the storage is closed")
        return run_sync(self.fs.loop, op, key, self._error, fn, *args)

    def _error(self, op: str, key: str, e: BaseException, attempts: int) -> StorageError:
        return storage_error(op, self._client.where(key), self.bucket, e, attempts)

    # ----------------------------------------------------------------- writes

    #: write_file also takes its pieces from an iterator, copying them into parts as they
    #: come (see _write_stream): a save staged in windows can be written here.
    writes_in_order = True

    def write_file(self, path: str, buffers: Sequence[memoryview]) -> None:
        """Write the concatenation of ``buffers`` to ``path``; no view of them is kept."""
        if not isinstance(buffers, Sequence):
            self._write_stream(path, buffers)
            return
        self._run("write", path, self._write, self._key(path), buffers)

    def _write_stream(self, path: str, pieces: Iterable[memoryview]) -> None:
        write_stream(self, path, pieces)

    def _result(self, results: Callable[[], T], path: str) -> T:
        """What ``results`` gives; a failure becomes a StorageError, as in _run."""
        with storage_errors("write", self._key(path), self._error):
            return results()

    async def _write(self, key: str, buffers: Sequence[memoryview]) -> None:
        await self._uploads.flush_aborts()
        views = [memoryview(b).cast("B") for b in buffers]
        try:
            total = sum(len(v) for v in views)
            if total < self.options.multipart_threshold:
                body: memoryview | bytes = views[0] if len(views) == 1 else b"".join(views)
                await self._create(key, body)
            else:
                await self._uploads.upload(key, views, total)
        finally:
            for v in views:
                v.release()

    async def _put(
        self, key: str, body: memoryview | bytes, *, create: dict[str, str] | None = None
    ) -> None:
        """One PutObject of ``body``; with ``create`` (the object's metadata), only where no
        object is (``If-None-Match: *``)."""
        kwargs: dict[str, Any] = {"Key": key}
        if create is not None:
            kwargs["IfNoneMatch"] = "*"
            kwargs["Metadata"] = create
        kwargs.update(await checksum_params(self.options.checksum, body))
        kwargs["Body"] = ViewPayload(memoryview(body)) if len(body) else b""
        await self._client.call("write", key, "put_object", **kwargs)

    async def _create(self, key: str, body: memoryview | bytes) -> None:
        """One PUT of ``body`` with ``If-None-Match: *``: S3 creates the object only where
        none is, and answers 412 otherwise, which is an EEXIST, never retried. A PUT sent
        again after its answer was lost (by the retries here, or by aiohttp itself, which
        resends an idempotent request once when a kept-alive connection turns out closed)
        meets its own first try: the object is ours when it carries this write's token."""
        token = write_token()
        try:
            await self._put(key, body, create=token)
        except GaveUp as e:
            if not is_precondition_failed(e.cause):
                raise
            if not await self._client.holds(key, token):
                raise exists_error(self._client.where(key)) from None

    def put_atomic(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path``: readers see all of it or none of it."""
        # One PUT: S3 shows readers all of an object or none of it.
        self._run("write", path, self._put, self._key(path), bytes(data))

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless an object is there (False then): one PUT
        with ``If-None-Match: *``, which S3 answers 412 when the key exists."""
        return bool(self._run("create", path, self._put_if_absent, self._key(path), bytes(data)))

    async def _put_if_absent(self, key: str, data: bytes) -> bool:
        kwargs: dict[str, Any] = {"Key": key, "IfNoneMatch": "*", "Body": data}
        kwargs.update(await checksum_params(self.options.checksum, data))
        for _ in range(_CONFLICT_TRIES):
            try:
                await self._client.call("create", key, "put_object", **kwargs)
                return True
            except GaveUp as e:
                code, status = error_code(e.cause)
                if status == 409 or code == "ConditionalRequestConflict":
                    await asyncio.sleep(0.05)  # another conditional PUT of the key in flight
                    continue
                if status != 412 and code != "PreconditionFailed":
                    raise
                # The PUT may have been sent twice (retried here, or resent by aiohttp on a
                # kept-alive connection found closed): its first try may have landed, and
                # then the object is ours.
                reply = await self._client.call("create", key, "get_object", Key=key)
                async with reply["Body"] as body:
                    return bool(await body.read() == data)
        raise StorageError(
            f"create {self._client.where(key)} failed: conditional writes of the key kept "
            f"conflicting ({_CONFLICT_TRIES} tries)",
            path=self._client.where(key),
        )

    def makedirs(self, path: str) -> None:
        """S3 has no directories; this never calls s3fs's makedirs (which creates buckets)."""

    def delete(self, path: str, *, recursive: bool = False) -> None:
        """Delete the object ``path``, or with ``recursive`` also everything under it."""
        self._run("delete", path, self._delete, self._key(path), recursive)

    async def _delete(self, key: str, recursive: bool) -> None:
        await self._uploads.flush_aborts()
        if not recursive:
            await self._client.call("delete", key, "delete_object", Key=key)
            return
        prefix = key + "/" if key else ""
        keys = [key, *[k async for k in self._client.keys_under(prefix)]]
        for i in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": k} for k in keys[i : i + DELETE_BATCH] if k]
            if batch:
                await self._delete_batch(key, batch)
        # Uploads still open under the prefix (a save that died) are part of what goes.
        async for upload_key, upload_id in self._client.uploads_under(prefix):
            await self._uploads.abort(upload_key, upload_id)

    async def _delete_batch(self, key: str, batch: list[dict[str, str]]) -> None:
        reply = await self._client.call(
            "delete", key, "delete_objects", Delete={"Objects": batch, "Quiet": True}
        )
        errors = reply.get("Errors") or []
        if errors:
            first = errors[0]
            raise GaveUp(
                "delete", first.get("Key", key), ClientError({"Error": first}, "DeleteObjects"), 1
            )

    def pending_aborts(self) -> list[tuple[str, str]]:
        """Multipart uploads (key, upload id) that failed to abort and will be retried."""
        return list(self._uploads.pending_aborts)

    # ----------------------------------------------------------------- reads

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of ``path``."""
        if start < 0 or end < start:
            raise ValueError(f"bad byte range [{start}, {end})")
        out = bytearray(end - start)
        self.readinto(path, start, memoryview(out))
        return bytes(out)

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``path`` from ``offset`` on."""
        view = memoryview(out).cast("B")
        try:
            self._run("read", path, self._readinto, self._key(path), offset, view)
        finally:
            view.release()

    async def _readinto(self, key: str, offset: int, out: memoryview) -> None:
        await download_into(
            self._client,
            key,
            offset,
            out,
            self.options.read_part_size,
            self.options.read_concurrency,
        )

    def size(self, path: str) -> int:
        """The size of the object ``path`` in bytes."""
        return self._run("stat", path, self._size, self._key(path))

    async def _size(self, key: str) -> int:
        return int((await self._client.head("stat", key))["ContentLength"])

    def exists(self, path: str) -> bool:
        """Whether ``path`` is an object, or a "directory" with something under it."""
        return self._run("stat", path, self._exists, self._key(path))

    async def _exists(self, key: str) -> bool:
        if key:
            try:
                await self._client.call("stat", key, "head_object", Key=key)
                return True
            except GaveUp as e:
                if error_code(e.cause)[1] != 404:
                    raise
        # Not an object: a "directory" exists when something lies under it. This listing
        # also turns a missing bucket into NoSuchBucket rather than a bare 404.
        prefix = key + "/" if key else ""
        reply = await self._client.call("stat", key, "list_objects_v2", Prefix=prefix, MaxKeys=1)
        return bool(reply.get("KeyCount") or reply.get("Contents"))

    def list_dir(self, path: str) -> list[str]:
        """The names directly under ``path``, objects and "directories", sorted."""
        # Always a fresh listing: we never use s3fs's listing cache, and another process
        # (another rank's daemon) may have written since.
        return self._run("list", path, self._list_dir, self._key(path))

    async def _list_dir(self, key: str) -> list[str]:
        prefix = key + "/" if key else ""
        names: set[str] = set()
        async for reply in self._client.listing("list", key, Prefix=prefix, Delimiter="/"):
            for p in reply.get("CommonPrefixes") or []:
                names.add(p["Prefix"][len(prefix) :].rstrip("/"))
            for obj in reply.get("Contents") or []:
                names.add(obj["Key"][len(prefix) :])
        names.discard("")
        return sorted(names)

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Retry aborts that failed earlier, then close the HTTP client."""
        if self._closed:
            return
        try:
            fsspec.asyn.sync(self.fs.loop, self._uploads.flush_aborts)
        except Exception as e:  # close must not fail; what is left is logged
            log.warning("closing %s: %s", self.url, e)
        for key, upload_id in self._uploads.pending_aborts:
            log.warning(
                "multipart upload %s of %s could not be aborted; its parts remain until a "
                "bucket lifecycle rule (AbortIncompleteMultipartUpload) removes them",
                upload_id,
                self._client.where(key),
            )
        self._closed = True
        creator = getattr(self.fs, "_s3creator", None)
        if creator is not None and getattr(self.fs, "_s3", None) is not None:
            with contextlib.suppress(Exception):
                fsspec.asyn.sync(self.fs.loop, creator.__aexit__, None, None, None, timeout=10)
            self.fs._s3 = None


def open_s3(url: str, storage_options: dict[str, Any]) -> S3Storage:
    """The ``aiockpt.storage`` entry point for ``s3://`` and ``s3a://``."""
    return S3Storage(url, storage_options)
