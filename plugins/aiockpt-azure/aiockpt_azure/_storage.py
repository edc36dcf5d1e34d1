"""aiockpt's Storage on Azure Blob Storage, through the blob client that adlfs owns.

adlfs gives us credentials (account key, SAS, connection string, azure-identity), the account
URL and its IO event loop (a dedicated thread); the transfers are ours, on the same
``azure.storage.blob.aio`` client:

- small files are one ``Put Blob``; large ones are blocks staged ``concurrency`` at a time
  from the caller's buffers, then one ``Put Block List``: the blob exists only once the list
  is committed, so a failed write leaves no blob (staged blocks that are never committed are
  dropped by the service);
- a write creates, and never replaces: its ``Put Blob`` or ``Put Block List`` carries
  ``If-None-Match: *``, so Azure makes the blob only where none is (409 or 412 otherwise,
  which is ``errno.EEXIST``); each create carries a token of its own in the blob's
  metadata, by which a retry after a lost answer knows its own blob;
- ``put_if_absent`` is ``Put Blob`` with ``If-None-Match: *``: Azure answers 409
  ``BlobAlreadyExists`` when the blob exists, so of racing writers exactly one wins;
- reads are ranged ``Get Blob`` calls; listings are always fresh (``delimiter=/``).

Every call is retried on transient errors with bounded, jittered backoff; the SDK's own retry
policy is off for our calls (``retry_total=0``), so the two do not multiply.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno as errno_mod
import itertools
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec.asyn

from aiockpt.errors import StorageError
from aiockpt.storage.objects import (
    GaveUp,
    Retrier,
    check_int,
    check_seconds,
    clear_frames,
    failed,
    gather_or_cancel,
    key_under,
    run_sync,
    settle,
    split_options,
    storage_errors,
)
from aiockpt.storage.parts import InFlight, cut_parts

__all__ = ["AzureOptions", "AzureStorage", "open_azure"]

log = logging.getLogger("aiockpt")
T = TypeVar("T")
MiB = 1024 * 1024
MAX_BLOCKS = 50_000  # Azure's limit of blocks per blob
#: The metadata key holding a create's own token.
TOKEN_KEY = "aiockptwrite"  # metadata names are C# identifiers: no '-'


def write_token() -> dict[str, str]:
    """The metadata a create puts on its blob: a token no other write has, by which a create
    refused as a conflict tells its own blob (an earlier try whose answer was lost) from
    another writer's."""
    return {TOKEN_KEY: uuid.uuid4().hex}


@dataclass(frozen=True, kw_only=True)
class AzureOptions:
    """The plugin's own ``storage_options``; every other key goes to adlfs."""

    #: Bytes per staged block (and per ranged GET of a read); raised when a file would need
    #: more than 50,000 blocks.
    block_size: int = 16 * MiB
    #: Files of at least this many bytes go up as staged blocks, smaller ones in one Put Blob.
    single_put_threshold: int = 16 * MiB
    #: Blocks staged (and ranges read) at once per file; blobs deleted at once.
    concurrency: int = 8
    #: Retries of one call after a transient error (throttling, 5xx, connection errors).
    retries: int = 5
    #: First backoff in seconds; doubles each retry, jittered, capped at ``max_backoff``.
    backoff: float = 0.2
    max_backoff: float = 10.0

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 64 * 1024, 4000 * MiB)
        check_int("single_put_threshold", self.single_put_threshold, 1, 5000 * MiB)
        check_int("concurrency", self.concurrency, 1, 1024)
        check_int("retries", self.retries, 0, 100)
        for name in ("backoff", "max_backoff"):
            check_seconds(name, getattr(self, name))

    @classmethod
    def split(cls, options: dict[str, Any]) -> tuple[AzureOptions, dict[str, Any]]:
        """This plugin's options out of ``options``, and the rest (for adlfs)."""
        return split_options(cls, options)


def _status(e: BaseException) -> int:
    return int(getattr(e, "status_code", 0) or 0)


def _code(e: BaseException) -> str:
    return str(getattr(e, "error_code", "") or "")


def is_transient(e: BaseException) -> bool:
    """Whether a retry of the call that raised ``e`` may succeed."""
    import aiohttp
    from azure.core.exceptions import (
        HttpResponseError,
        ServiceRequestError,
        ServiceResponseError,
    )

    if isinstance(e, (ServiceRequestError, ServiceResponseError)):
        return True  # the request did not get through, or no answer came back
    if isinstance(e, HttpResponseError):
        return _status(e) >= 500 or _status(e) in (408, 429)
    return isinstance(e, (aiohttp.ClientError, ConnectionError, TimeoutError))


class AzureStorage:
    """A checkpoint root ``az://container/prefix``. Methods are blocking and thread-safe."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import adlfs  # imported here: the entry point module stays cheap to load

        self.url = url
        protocol, sep, rest = url.partition("://")
        if not sep or protocol not in ("az", "abfs", "abfss"):
            raise ValueError(f"not an Azure URL: {url!r}")
        container, _, prefix = rest.partition("/")
        options = dict(storage_options or {})
        if "@" in container:  # abfs://container@account.dfs.core.windows.net/path
            container, _, host = container.partition("@")
            options.setdefault("account_name", host.split(".", 1)[0])
        if not container:
            raise ValueError(f"no container in {url!r}")
        self.container = container
        self.prefix = prefix.strip("/")
        self.options, fs_options = AzureOptions.split(options)
        self._retrier = Retrier(self.options, transient=is_transient, where=self.where)
        if fs_options.get("asynchronous"):
            raise ValueError(
                "storage option 'asynchronous' is not supported: aiockpt owns the loop"
            )
        fs_options.setdefault("skip_instance_cache", True)
        self.fs = adlfs.AzureBlobFileSystem(**fs_options)
        self._container = self.fs.service_client.get_container_client(container)
        self._closed = False

    # ----------------------------------------------------------------- plumbing

    def _key(self, path: str) -> str:
        return key_under(self.prefix, path)

    def where(self, key: str) -> str:
        return f"az://{self.container}/{key}"

    def _run(self, op: str, path: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run a coroutine on adlfs's loop thread; any failure becomes a StorageError."""
        key = self._key(path)
        if self._closed:
            raise StorageError(f"{op} {self.where(key)}: the storage is closed")
        return run_sync(self.fs.loop, op, key, self._error, fn, *args)

    def _error(self, op: str, key: str, e: BaseException, attempts: int) -> StorageError:
        status, code = _status(e), _code(e)
        reason: tuple[str, int] | None = None
        if code == "ContainerNotFound":
            reason = f"the container {self.container!r} does not exist", errno_mod.ENOENT
        elif status == 404:
            reason = "no such blob", errno_mod.ENOENT
        elif status == 403:
            reason = f"access denied ({code or e})", errno_mod.EACCES
        elif status == 416:
            reason = "the blob ends before the requested range", errno_mod.EIO
        return failed(op, self.where(key), e, attempts, reason)

    # ----------------------------------------------------------------- writes

    #: write_file also takes its pieces from an iterator, copying them into blocks as they
    #: come (see _write_stream): a save staged in windows can be written here.
    writes_in_order = True

    def write_file(self, path: str, buffers: Sequence[memoryview]) -> None:
        """Write the concatenation of ``buffers`` to ``path``; no view of them is kept."""
        if not isinstance(buffers, Sequence):
            self._write_stream(path, buffers)
            return
        self._run("write", path, self._write, self._key(path), buffers)

    def _write_stream(self, path: str, pieces: Iterable[memoryview]) -> None:
        """Write pieces that come from an iterator, each taken before the next is asked for:
        they are copied into blocks, each staged as it fills, at most ``concurrency`` at once,
        then the block list committed. Blocks double in size every 5,000, so Azure's 50,000
        blocks reach past 1 PiB; a blob under ``single_put_threshold`` is one Put Blob."""
        key = self._key(path)
        blocks = cut_parts(pieces, self.options.block_size, double_every=MAX_BLOCKS // 10)
        head: list[bytes] = []  # blocks held until the blob is known to need staging
        for block in blocks:
            head.append(block)
            if sum(map(len, head)) >= self.options.single_put_threshold:
                break
        else:
            self._run("write", path, self._create_blob, key, b"".join(head))
            return
        blob = self._container.get_blob_client(key)
        staging = InFlight(self.fs.loop, self.options.concurrency)
        ids: list[str] = []
        try:
            for block in itertools.chain(head, blocks):
                ids.append(base64.b64encode(f"{len(ids):08d}".encode()).decode())
                head = []
                if not staging.submit(self._call_stage(key, blob, ids[-1], block)):
                    break  # a block failed: _wait_all raises its error
            self._wait_all(staging, path)
            self._run("write", path, self._commit, key, blob, ids)
        except BaseException:
            staging.cancel()
            raise

    async def _call_stage(self, key: str, blob: Any, block_id: str, data: bytes) -> None:
        await self._retrier.run("write", key, lambda: self._stage(blob, block_id, data))

    async def _commit(self, key: str, blob: Any, ids: list[str]) -> None:
        """Commit the block list ``ids`` as the blob ``key``, only where no blob is
        (``If-None-Match: *``); a conflict is EEXIST unless the blob there is this commit's
        own (see :meth:`_created`)."""
        from azure.core import MatchConditions
        from azure.storage.blob import BlobBlock

        blocks = [BlobBlock(block_id=i) for i in ids]
        token = write_token()
        await self._created(
            key,
            token,
            lambda: blob.commit_block_list(
                blocks,
                metadata=token,
                match_condition=MatchConditions.IfMissing,
                retry_total=0,
            ),
        )

    async def _created(
        self, key: str, token: dict[str, str], call: Callable[[], Awaitable[Any]]
    ) -> None:
        """Run ``call``, a conditional create of ``key`` carrying ``token``, retried. Azure
        refuses it when a blob is there (409 ``BlobAlreadyExists``, or 412); that is EEXIST,
        not retried, unless the blob carries ``token``: the create's own earlier try, whose
        answer was lost (retried here, or resent by aiohttp on a kept-alive connection that
        turned out closed)."""
        try:
            await self._retrier.run("write", key, call)
        except GaveUp as e:
            if _status(e.cause) not in (409, 412):
                raise
            if await self._token_of(key) != token[TOKEN_KEY]:
                raise _exists_error(self.where(key)) from None

    async def _token_of(self, key: str) -> str | None:
        """The create token the blob ``key`` carries (None without one)."""
        blob = self._container.get_blob_client(key)
        props = await self._retrier.run(
            "write", key, lambda: blob.get_blob_properties(retry_total=0)
        )
        token = (props.metadata or {}).get(TOKEN_KEY)
        return str(token) if token is not None else None

    def _wait_all(self, staging: InFlight, path: str) -> None:
        """Wait for every staged block; a failure becomes a StorageError, as in _run."""
        with storage_errors("write", self._key(path), self._error):
            staging.results()

    async def _write(self, key: str, buffers: Sequence[memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        try:
            total = sum(len(v) for v in views)
            if total < self.options.single_put_threshold:
                await self._create_blob(key, b"".join(views))
            else:
                await self._staged(key, views, total)
        finally:
            for v in views:
                v.release()

    async def _put(self, key: str, data: bytes, overwrite: bool) -> None:
        blob = self._container.get_blob_client(key)
        op = "write" if overwrite else "create"
        await self._retrier.run(
            op,
            key,
            lambda: blob.upload_blob(
                data, overwrite=overwrite, length=len(data), max_concurrency=1, retry_total=0
            ),
        )

    async def _create_blob(self, key: str, data: bytes) -> None:
        """One Put Blob of ``data`` with ``If-None-Match: *`` (``overwrite=False``): see
        :meth:`_created`."""
        blob = self._container.get_blob_client(key)
        token = write_token()
        await self._created(
            key,
            token,
            lambda: blob.upload_blob(
                data,
                overwrite=False,
                metadata=token,
                length=len(data),
                max_concurrency=1,
                retry_total=0,
            ),
        )

    async def _staged(self, key: str, views: list[memoryview], total: int) -> None:
        blob = self._container.get_blob_client(key)
        size = max(self.options.block_size, -(-total // MAX_BLOCKS))
        ranges = [(start, min(start + size, total)) for start in range(0, total, size)]
        ids = [base64.b64encode(f"{i:08d}".encode()).decode() for i in range(len(ranges))]
        todo = iter(zip(ids, ranges, strict=True))

        async def worker() -> None:
            for block_id, (start, stop) in todo:  # shared iterator: each block taken once
                await self._retrier.run(
                    "write",
                    key,
                    lambda b=block_id, lo=start, hi=stop: self._stage(  # type: ignore[misc]
                        blob, b, _slice(views, lo, hi)
                    ),
                )

        await gather_or_cancel(
            [worker() for _ in range(min(self.options.concurrency, len(ranges)))]
        )
        await self._commit(key, blob, ids)

    async def _stage(self, blob: Any, block_id: str, data: memoryview | bytes) -> None:
        """Stage one block, its body sent in 1 MiB copies of the caller's memory (aiohttp
        would warn on a larger write, which holds the loop)."""
        writers: set[asyncio.Task[Any]] = set()
        held: list[memoryview | bytes] = [data]
        body = _slices(held, writers)
        try:
            await blob.stage_block(block_id, body, length=len(data), retry_total=0)
        finally:
            # aiohttp may leave its writer task sending the body after a failed request, and
            # its error, with the frames it went through, until the error is taken.
            for e in await settle(writers):
                clear_frames(e)
            writers.clear()
            held.clear()  # the body, even if never started, holds no view of the caller's
            with contextlib.suppress(RuntimeError):
                await body.aclose()

    def put_atomic(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path``: one Put Blob, all there or not there."""
        self._run("write", path, self._put, self._key(path), bytes(data), True)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless a blob is there (False then): one Put Blob
        with ``If-None-Match: *``."""
        return bool(self._run("create", path, self._create, self._key(path), bytes(data)))

    async def _create(self, key: str, data: bytes) -> bool:
        try:
            await self._put(key, data, False)
            return True
        except GaveUp as e:
            if _status(e.cause) not in (409, 412):
                raise
        # The Put Blob may have been sent twice (retried here, or resent by aiohttp, which
        # sends an idempotent request again when a kept-alive connection turns out closed):
        # its first try may have landed, and then the blob is ours.
        return bool(await self._read(key, 0, len(data) + 1, exact=False) == data)

    def makedirs(self, path: str) -> None:
        """Blob storage has no directories (a name with "/" in it is enough)."""

    def delete(self, path: str, *, recursive: bool = False) -> None:
        """Delete the blob ``path``, or with ``recursive`` also everything under it."""
        self._run("delete", path, self._delete, self._key(path), recursive)

    async def _delete(self, key: str, recursive: bool) -> None:
        keys = [key] if key else []
        if recursive:
            keys += await self._names(key + "/" if key else "", delimited=False)
        sem = asyncio.Semaphore(self.options.concurrency)

        async def one(k: str) -> None:
            async with sem:
                blob = self._container.get_blob_client(k)
                try:
                    await self._retrier.run("delete", k, lambda: blob.delete_blob(retry_total=0))
                except GaveUp as e:
                    if _status(e.cause) != 404 or _code(e.cause) == "ContainerNotFound":
                        raise

        await gather_or_cancel([one(k) for k in keys])

    # ----------------------------------------------------------------- reads

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of ``path``."""
        if start < 0 or end < start:
            raise ValueError(f"bad byte range [{start}, {end})")
        return self._run("read", path, self._read, self._key(path), start, end - start)

    async def _read(self, key: str, offset: int, length: int, *, exact: bool = True) -> bytes:
        if length == 0:
            await self._size(key)  # a missing blob is still an error
            return b""
        blob = self._container.get_blob_client(key)

        async def get() -> bytes:
            stream = await blob.download_blob(
                offset=offset, length=length, max_concurrency=1, retry_total=0
            )
            return bytes(await stream.readall())

        data = await self._retrier.run("read", key, get)
        if exact and len(data) != length:
            raise StorageError(
                f"read {self.where(key)} failed: the blob ends before byte {offset + length}",
                path=self.where(key),
                errno=errno_mod.EIO,
            )
        return data

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``path`` from ``offset`` on."""
        view = memoryview(out).cast("B")
        try:
            self._run("read", path, self._readinto, self._key(path), offset, view)
        finally:
            view.release()

    async def _readinto(self, key: str, offset: int, out: memoryview) -> None:
        if len(out) == 0:
            await self._size(key)
            return
        step = self.options.block_size
        sem = asyncio.Semaphore(self.options.concurrency)

        async def one(lo: int, hi: int) -> None:
            async with sem:
                out[lo:hi] = await self._read(key, offset + lo, hi - lo)

        await gather_or_cancel(
            [one(lo, min(lo + step, len(out))) for lo in range(0, len(out), step)]
        )

    def size(self, path: str) -> int:
        """The size of the blob ``path`` in bytes."""
        return self._run("stat", path, self._size, self._key(path))

    async def _size(self, key: str) -> int:
        blob = self._container.get_blob_client(key)
        props = await self._retrier.run(
            "stat", key, lambda: blob.get_blob_properties(retry_total=0)
        )
        return int(props.size)

    def exists(self, path: str) -> bool:
        """Whether ``path`` is a blob, or a "directory" with something under it."""
        return self._run("stat", path, self._exists, self._key(path))

    async def _exists(self, key: str) -> bool:
        if key:
            try:
                await self._size(key)
                return True
            except GaveUp as e:
                if _status(e.cause) != 404 or _code(e.cause) == "ContainerNotFound":
                    raise
        return bool(await self._names(key + "/" if key else "", delimited=False, limit=1))

    def list_dir(self, path: str) -> list[str]:
        """The names directly under ``path``, blobs and "directories", sorted."""
        return self._run("list", path, self._list_dir, self._key(path))

    async def _list_dir(self, key: str) -> list[str]:
        prefix = key + "/" if key else ""
        names = {n[len(prefix) :].rstrip("/") for n in await self._names(prefix, delimited=True)}
        names.discard("")
        return sorted(names)

    async def _names(self, prefix: str, *, delimited: bool, limit: int | None = None) -> list[str]:
        """Blob names under ``prefix`` (and "directory" prefixes, when ``delimited``)."""

        async def listing() -> list[str]:
            out: list[str] = []
            if delimited:
                pages = self._container.walk_blobs(
                    name_starts_with=prefix, delimiter="/", retry_total=0
                )
            else:
                pages = self._container.list_blobs(name_starts_with=prefix, retry_total=0)
            async for item in pages:
                out.append(item.name)
                if limit is not None and len(out) >= limit:
                    break
            return out

        return await self._retrier.run("list", prefix, listing)

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close the blob client; the storage is not used after this."""
        if self._closed:
            return
        self._closed = True
        try:
            fsspec.asyn.sync(self.fs.loop, self._close, timeout=10)
        except Exception as e:  # close must not fail
            log.warning("closing %s: %s", self.url, e)

    async def _close(self) -> None:
        await self._container.close()
        await self.fs.service_client.close()
        credential = getattr(self.fs, "credential", None)
        if credential is not None and hasattr(credential, "close"):
            result = credential.close()
            if asyncio.iscoroutine(result):
                await result


async def _slices(
    held: list[memoryview | bytes], writers: set[asyncio.Task[Any]]
) -> AsyncGenerator[bytes, None]:
    """The bytes ``held`` holds, as 1 MiB copies; the tasks that iterate it go into
    ``writers``. Copies, not views: a failed send leaves what it was sending to errors that
    aiohttp and asyncio keep where no frame clearing reaches (a reset connection's error, in
    a reference cycle of its protocol), and a view there would keep the caller's shared memory
    from being unmapped until the garbage collector ran. The copy costs a memcpy per byte,
    well under what sending it does; asyncio copies what the socket does not take at once."""
    task = asyncio.current_task()
    if task is not None:
        writers.add(task)
    size = len(held[0]) if held else 0
    for start in range(0, size, MiB):
        if not held:
            return
        with memoryview(held[0])[start : start + MiB] as piece:
            chunk = bytes(piece)
        yield chunk


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


def _exists_error(where: str) -> StorageError:
    """The failure of a write onto a blob that is there already (``errno.EEXIST``)."""
    return StorageError(
        f"create {where} failed: a blob is there already (a write never replaces one)",
        path=where,
        errno=errno_mod.EEXIST,
    )


def open_azure(url: str, storage_options: dict[str, Any]) -> AzureStorage:
    """The ``aiockpt.storage`` entry point for ``az://``, ``abfs://`` and ``abfss://``."""
    return AzureStorage(url, storage_options)
