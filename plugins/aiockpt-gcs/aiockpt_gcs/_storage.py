"""aiockpt's Storage on Google Cloud Storage, through the session and credentials of gcsfs.

gcsfs gives us credentials (every source google-auth knows), the endpoint (``endpoint_url``
or ``STORAGE_EMULATOR_HOST``) and its IO event loop (a dedicated thread); the requests are
ours, against the JSON API:

- a write creates, and never replaces: its upload (and the compose that makes a streamed
  file) carries ``ifGenerationMatch=0``, so GCS makes the object only where none is and
  answers 412 otherwise, which is ``errno.EEXIST``; each create carries a token of its own in
  the object's metadata, by which a retry after a lost answer knows its own object;
- every write is ONE multipart upload (``uploadType=multipart``): the object's metadata, with
  the CRC32C of its bytes, then the bytes, streamed from the caller's buffers. GCS creates the
  object only when the whole body has arrived and its checksum matches, so a failed write
  leaves nothing behind, and there is no upload session to clean up (a resumable upload that
  dies leaves one, and the emulator the tests use shows its bytes as an object meanwhile);
- a write whose pieces come from an iterator (a save staged in windows) is cut into parts,
  each such an upload of an object of its own, ``concurrency`` at once, then composed into
  the object by GCS (``objects.compose``), which again appears whole or not at all;
- ``put_if_absent`` is the same upload with ``ifGenerationMatch=0``: GCS creates the object
  only if no live generation of it exists, and answers 412 otherwise;
- reads are ranged GETs (``alt=media``), split into ``part_size`` ranges run ``concurrency``
  at a time, written straight into the caller's buffer;
- listings are always fresh ``objects.list`` calls with ``delimiter=/``: GCS lists strongly
  consistently, and gcsfs's listing cache is never used.

Every request is retried on transient errors (429, 408, 5xx, connection errors, timeouts) with
bounded, jittered backoff; gcsfs's own retries (six tries, up to a minute) are not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as errno_mod
import itertools
import json
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import crc32c
import fsspec.asyn

from aiockpt.errors import StorageError
from aiockpt.storage.objects import (
    GaveUp,
    crc32c_combine,
    gather_or_cancel,
    key_under,
    run_sync,
    storage_errors,
)
from aiockpt.storage.parts import InFlight, cut_parts

from ._client import (
    TOKEN_KEY,
    BucketClient,
    ViewsPayload,
    as_b64,
    crc32c_b64,
    exists_error,
    status_of,
    storage_error,
    write_token,
)
from ._options import GCSOptions

__all__ = ["GCSOptions", "GCSStorage", "open_gcs"]

#: Sources one ``objects.compose`` request may name (GCS's limit).
MAX_COMPOSE = 32

T = TypeVar("T")


class GCSStorage:
    """A checkpoint root ``gs://bucket/prefix``. Methods are blocking and thread-safe."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import gcsfs  # imported here: the entry point module stays cheap to load

        self.url = url
        protocol, sep, rest = url.partition("://")
        if not sep or protocol not in ("gs", "gcs"):
            raise ValueError(f"not a GCS URL: {url!r}")
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {url!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.options, fs_options = GCSOptions.split(dict(storage_options or {}))
        if fs_options.get("asynchronous"):
            raise ValueError(
                "storage option 'asynchronous' is not supported: aiockpt owns the loop"
            )
        # Our own instance: gcsfs caches instances by arguments, and we close ours.
        fs_options.setdefault("skip_instance_cache", True)
        with warnings.catch_warnings():
            # gcsfs warns when no project is given; one is needed only to list or make buckets.
            warnings.filterwarnings("ignore", message="GCS project not set")
            self.fs = gcsfs.GCSFileSystem(**fs_options)
        self._client = BucketClient(self.fs, bucket, self.options)
        self._closed = False

    # ----------------------------------------------------------------- plumbing

    def _key(self, path: str) -> str:
        return key_under(self.prefix, path)

    def _run(self, op: str, path: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run a coroutine on gcsfs's loop thread; any failure becomes a StorageError."""
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
        self._run("write", path, self._write_new, self._key(path), buffers)

    def _write_stream(self, path: str, pieces: Iterable[memoryview]) -> None:
        """Write pieces that come from an iterator, each taken before the next is asked for:
        they are copied into parts of ``part_size`` bytes, each uploaded as an object of its
        own beside the file, at most ``concurrency`` at once (so this holds at most that many
        parts), then composed into the file by GCS, 32 sources a request; a file of one part
        is one upload. The file appears whole or not at all: a write that fails before the
        last compose leaves what was there. The parts go either way; one left by a crash lies
        in its step's directory, removed with the step if it never committed."""
        key = self._key(path)
        parts = cut_parts(pieces, self.options.part_size)
        first = next(parts, b"")
        second = next(parts, None)
        if second is None:
            self._run("write", path, self._write_new, key, [first])
            return
        stem = f"{key}.part-{uuid.uuid4().hex[:16]}"
        made: list[str] = []  # every part and intermediate object, to delete at the end
        checksum = self.options.checksum == "crc32c"
        whole = 0
        sending = InFlight(self.fs.loop, self.options.concurrency)
        try:
            for part in itertools.chain((first, second), parts):
                first = second = b""  # else these two parts stay held to the end
                made.append(f"{stem}-{len(made):06d}")
                crc = crc32c.crc32c(part) if checksum else None
                if crc is not None:
                    whole = crc32c_combine(whole, crc, len(part))
                if not sending.submit(self._write_new(made[-1], [part], crc)):
                    break  # a part failed: results() raises its error
            with storage_errors("write", key, self._error):
                sending.results()
            sources = list(made)
            self._run("write", path, self._compose, key, sources, made, whole if checksum else None)
        except BaseException:
            # Not cancelled: a part whose request is cut short may still be made by GCS after
            # the deletes below; the parts in flight (``concurrency`` at most) end first.
            sending.wait()
            raise
        finally:
            with contextlib.suppress(Exception):
                self._run("delete", path, self._delete_keys, made)

    async def _compose(
        self, key: str, sources: list[str], made: list[str], crc: int | None
    ) -> None:
        """Compose ``sources``, in order, into ``key``: first into intermediate objects of
        32 sources each (named in ``made``, for the caller to delete) until one request can
        name them all. With ``crc``, the object GCS made must have it (GCS checked each
        part; this checks that they were put together in the right order): if not, it is
        deleted and the write fails."""
        level = 0
        while len(sources) > MAX_COMPOSE:
            groups = [sources[i : i + MAX_COMPOSE] for i in range(0, len(sources), MAX_COMPOSE)]
            names = [f"{key}.part-c{level}-{uuid.uuid4().hex[:16]}" for _ in groups]
            made += names
            await gather_or_cancel(
                self._compose_one(n, g) for n, g in zip(names, groups, strict=True)
            )
            sources, level = names, level + 1
        obj = await self._compose_one(key, sources)
        if crc is not None and obj.get("crc32c") != as_b64(crc):
            with contextlib.suppress(GaveUp):
                await self._delete_keys([key])
            where = self._client.where(key)
            raise StorageError(
                f"write {where} failed: the object composed of its parts has crc32c "
                f"{obj.get('crc32c')}, not the parts' {as_b64(crc)}",
                path=where,
                errno=errno_mod.EIO,
            )

    async def _compose_one(self, key: str, sources: list[str]) -> dict[str, Any]:
        """One ``objects.compose`` request: ``sources`` into ``key``, created only where no
        object is (``ifGenerationMatch=0``: see :meth:`_write_new`); the object made."""
        token = write_token()
        body = json.dumps(
            {
                "sourceObjects": [{"name": s} for s in sources],
                "destination": {"contentType": "application/octet-stream", "metadata": token},
            }
        ).encode()
        try:
            reply = await self._client.call(
                "write",
                key,
                "POST",
                f"{self._client.object_url(key)}/compose",
                params={"ifGenerationMatch": "0"},
                headers={"Content-Type": "application/json"},
                body=lambda: body,
            )
        except GaveUp as e:
            if status_of(e.cause) != 412:
                raise
            obj = await self._ours(key, token)  # a retry after an answer that was lost?
            if obj is None:
                raise exists_error(self._client.where(key)) from None
            return obj
        made: dict[str, Any] = json.loads(reply.body)
        return made

    async def _write_new(
        self, key: str, buffers: Sequence[memoryview | bytes], crc: int | None = None
    ) -> None:
        """Create ``key`` holding ``buffers``, in one upload with ``ifGenerationMatch=0``:
        GCS makes the object only where none is and answers 412 otherwise, an EEXIST that
        is not retried. An upload retried after its answer was lost meets its own first
        try: the object is ours when it carries this write's token (its metadata)."""
        token = write_token()
        try:
            await self._write("write", key, buffers, True, crc, metadata=token)
        except GaveUp as e:
            if status_of(e.cause) != 412 or await self._ours(key, token) is None:
                if status_of(e.cause) == 412:
                    raise exists_error(self._client.where(key)) from None
                raise

    async def _ours(self, key: str, token: dict[str, str]) -> dict[str, Any] | None:
        """The object ``key``'s resource when it carries the create token ``token``."""
        reply = await self._client.call("write", key, "GET", self._client.object_url(key))
        obj: dict[str, Any] = json.loads(reply.body)
        held = (obj.get("metadata") or {}).get(TOKEN_KEY)
        return obj if held == token[TOKEN_KEY] else None

    def put_atomic(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path``: GCS shows readers all of an object or none of it."""
        self._run("write", path, self._write, "write", self._key(path), [bytes(data)], False)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless an object is there (False then): one upload
        with ``ifGenerationMatch=0``, which GCS answers 412 when the object exists."""
        return bool(self._run("create", path, self._create, self._key(path), bytes(data)))

    async def _create(self, key: str, data: bytes) -> bool:
        try:
            await self._write("create", key, [data], True)
            return True
        except GaveUp as e:
            if status_of(e.cause) != 412:
                raise
            if e.attempts == 1:
                return False
        # A retried upload: its first try may have landed, and then the object is ours.
        out = bytearray(len(data) + 1)
        reply = await self._client.call(
            "create",
            key,
            "GET",
            self._client.object_url(key),
            params={"alt": "media"},
            into=memoryview(out),
        )
        return bytes(out[: reply.received]) == data

    async def _write(
        self,
        op: str,
        key: str,
        buffers: Sequence[memoryview | bytes],
        if_absent: bool,
        crc: int | None = None,
        *,
        metadata: dict[str, str] | None = None,
    ) -> None:
        """Upload ``buffers`` as ``key`` in one request; ``crc``, their CRC32C if known;
        ``metadata``, the object's custom metadata."""
        views = [memoryview(b).cast("B") for b in buffers]
        try:
            meta: dict[str, Any] = {"name": key, "contentType": "application/octet-stream"}
            if metadata:
                meta["metadata"] = metadata
            if crc is not None:
                meta["crc32c"] = as_b64(crc)
            elif self.options.checksum == "crc32c":
                # crc32c releases the GIL: off the loop thread, other requests go on.
                loop = asyncio.get_running_loop()
                meta["crc32c"] = await loop.run_in_executor(None, crc32c_b64, views)
            boundary = f"aiockpt-{uuid.uuid4().hex}"
            content_type = f"multipart/related; boundary={boundary}"
            head = (
                f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                f"{json.dumps(meta)}\r\n--{boundary}\r\n"
                "Content-Type: application/octet-stream\r\n\r\n"
            ).encode()
            tail = f"\r\n--{boundary}--\r\n".encode()
            params = {"uploadType": "multipart"}
            if if_absent:
                params["ifGenerationMatch"] = "0"
            await self._client.call(
                op,
                key,
                "POST",
                self._client.uploads,
                params=params,
                headers={"Content-Type": content_type},
                body=lambda: ViewsPayload([head, *views, tail], content_type),
            )
        finally:
            for v in views:
                v.release()

    def makedirs(self, path: str) -> None:
        """GCS has no directories (a name with "/" in it is enough)."""

    def delete(self, path: str, *, recursive: bool = False) -> None:
        """Delete the object ``path``, or with ``recursive`` also everything under it."""
        self._run("delete", path, self._delete, self._key(path), recursive)

    async def _delete(self, key: str, recursive: bool) -> None:
        keys = [key] if key else []
        if recursive:
            keys += [k async for k in self._names(key + "/" if key else "", delimited=False)]
        await self._delete_keys(keys)

    async def _delete_keys(self, keys: list[str]) -> None:
        """Delete the objects ``keys``, ``concurrency`` at once; one that is gone is fine."""
        sem = asyncio.Semaphore(self.options.concurrency)

        async def one(k: str) -> None:
            async with sem:
                try:
                    await self._client.call("delete", k, "DELETE", self._client.object_url(k))
                except GaveUp as e:
                    if status_of(e.cause) != 404:  # gone already: a retried delete, or a race
                        raise

        await gather_or_cancel([one(k) for k in keys])

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
        if len(out) == 0:
            await self._size(key)  # a missing object is still an error
            return
        step = self.options.part_size
        sem = asyncio.Semaphore(self.options.concurrency)

        async def one(lo: int, hi: int) -> None:
            async with sem:
                start, end = offset + lo, offset + hi
                reply = await self._client.call(
                    "read",
                    key,
                    "GET",
                    self._client.object_url(key),
                    params={"alt": "media"},
                    headers={"Range": f"bytes={start}-{end - 1}"},
                    into=out[lo:hi],
                )
                if reply.received != hi - lo:
                    where = self._client.where(key)
                    raise StorageError(
                        f"read {where} failed: the object ends before byte {end}",
                        path=where,
                        errno=errno_mod.EIO,
                    )

        await gather_or_cancel(
            [one(lo, min(lo + step, len(out))) for lo in range(0, len(out), step)]
        )

    def size(self, path: str) -> int:
        """The size of the object ``path`` in bytes."""
        return self._run("stat", path, self._size, self._key(path))

    async def _size(self, key: str) -> int:
        reply = await self._client.call("stat", key, "GET", self._client.object_url(key))
        return int(json.loads(reply.body)["size"])

    def exists(self, path: str) -> bool:
        """Whether ``path`` is an object, or a "directory" with something under it."""
        return self._run("stat", path, self._exists, self._key(path))

    async def _exists(self, key: str) -> bool:
        if key:
            try:
                await self._client.call("stat", key, "GET", self._client.object_url(key))
                return True
            except GaveUp as e:
                if status_of(e.cause) != 404:
                    raise
        # Not an object: a "directory" exists when something lies under it. The listing also
        # tells a missing bucket (404) from a missing object.
        async for _ in self._names(key + "/" if key else "", delimited=False, limit=1):
            return True
        return False

    def list_dir(self, path: str) -> list[str]:
        """The names directly under ``path``, objects and "directories", sorted."""
        # Always a fresh listing: another process (another rank's daemon) may have written.
        return self._run("list", path, self._list_dir, self._key(path))

    async def _list_dir(self, key: str) -> list[str]:
        prefix = key + "/" if key else ""
        names = {n[len(prefix) :].rstrip("/") async for n in self._names(prefix, delimited=True)}
        names.discard("")
        return sorted(names)

    async def _names(self, prefix: str, *, delimited: bool, limit: int = 1000) -> Any:
        """Object names under ``prefix`` (and "directory" prefixes, when ``delimited``)."""
        params = {"prefix": prefix, "maxResults": str(limit)}
        if delimited:
            params["delimiter"] = "/"
        while True:
            reply = await self._client.call(
                "list", prefix, "GET", self._client.objects, params=params
            )
            page = json.loads(reply.body)
            for p in page.get("prefixes") or []:
                yield p
            for item in page.get("items") or []:
                yield item["name"]
            token = page.get("nextPageToken")
            if not token:
                return
            params["pageToken"] = token

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close the HTTP session; the storage is not used after this."""
        if self._closed:
            return
        self._closed = True
        session = getattr(self.fs, "_session", None)
        if session is not None and not session.closed:
            with contextlib.suppress(Exception):
                fsspec.asyn.sync(self.fs.loop, session.close, timeout=10)
        self.fs._session = None


def open_gcs(url: str, storage_options: dict[str, Any]) -> GCSStorage:
    """The ``aiockpt.storage`` entry point for ``gs://`` and ``gcs://``."""
    return GCSStorage(url, storage_options)
