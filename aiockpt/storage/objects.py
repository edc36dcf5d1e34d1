"""What every object-store plugin needs around its requests, written once.

A storage's methods are blocking; an object store's client is asynchronous, on the event loop
thread fsspec keeps for it. So a plugin runs a coroutine per call on that loop
(:func:`run_sync`), retries each request on the errors its store calls transient
(:class:`Retrier`, raising :class:`GaveUp` at the end), sends or reads the parts of a file
together and stops them all at the first failure (:func:`gather_or_cancel`), and turns
whatever failed into a :class:`~aiockpt.errors.StorageError` naming the object.

One duty runs through all of it: a write is handed views of the daemon's shared memory, and
no view may outlive the call (the memory is reused, or unmapped, once the call returns). The
frames of a traceback hold views in their locals, and an error kept anywhere (a task that
failed, a retry's history, the error an SDK wraps) keeps its traceback; so every error this
module drops or turns into another has its frames cleared (:func:`clear_frames`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import random
import traceback
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

import fsspec.asyn

from .._crc import combine as crc32c_combine
from ..errors import StorageError

__all__ = [
    "GaveUp",
    "Retrier",
    "RetryOptions",
    "check_int",
    "check_seconds",
    "clear_frames",
    "crc32c_combine",
    "failed",
    "gather_or_cancel",
    "key_under",
    "run_sync",
    "settle",
    "split_options",
    "storage_errors",
]

log = logging.getLogger("aiockpt")
T = TypeVar("T")
Opts = TypeVar("Opts")


class GaveUp(Exception):
    """A request failed for good: the error was not transient, or the retries ran out.
    ``op`` and ``key`` name the request, ``cause`` is its last error, ``attempts`` how many
    times it was sent."""

    def __init__(self, op: str, key: str, cause: BaseException, attempts: int) -> None:
        super().__init__(op, key)
        self.op, self.key, self.cause, self.attempts = op, key, cause, attempts


class RetryOptions(Protocol):
    """What a plugin's options say of retries (the three plugins name them alike)."""

    @property
    def retries(self) -> int:
        """Retries of one request after a transient error."""
        ...

    @property
    def backoff(self) -> float:
        """Seconds before the first retry; doubling each retry."""
        ...

    @property
    def max_backoff(self) -> float:
        """The longest wait before a retry, in seconds."""
        ...


class Retrier:
    """Sends a request again after a transient error, at most ``options.retries`` more times.

    The n-th retry waits ``options.backoff * 2**n`` seconds capped at ``options.max_backoff``,
    with equal jitter (half the wait fixed, half random) so that requests failing together
    do not retry together. ``transient(e)`` says whether a retry may succeed after ``e``;
    ``where(key)`` names a key in the log lines.
    """

    def __init__(
        self,
        options: RetryOptions,
        *,
        transient: Callable[[BaseException], bool],
        where: Callable[[str], str],
    ) -> None:
        self.retries = options.retries
        self.backoff = options.backoff
        self.max_backoff = options.max_backoff
        self._transient = transient
        self._where = where

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0 for the first)."""
        cap = min(self.max_backoff, self.backoff * (2**attempt))
        return cap / 2 + random.uniform(0, cap / 2)

    async def run(self, op: str, key: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn()``, called again after each transient error while retries are left; the
        last error is raised as :class:`GaveUp`."""
        attempt = 0
        while True:
            try:
                return await fn()
            except Exception as e:
                if attempt >= self.retries or not self._transient(e):
                    raise GaveUp(op, key, e, attempt + 1) from e
                log.debug("%s %s: %s; retry %d", op, self._where(key), e, attempt + 1)
                # Dropped, but not always freed: azure-core's retry policy keeps the error in
                # its history, which a frame of the error's own traceback holds (a cycle only
                # the garbage collector ends), and those frames hold views of the buffers.
                clear_frames(e)
            await asyncio.sleep(self.delay(attempt))
            attempt += 1


def run_sync(
    loop: asyncio.AbstractEventLoop,
    op: str,
    key: str,
    error: Callable[[str, str, BaseException, int], StorageError],
    fn: Callable[..., Awaitable[T]],
    *args: Any,
) -> T:
    """Run ``fn(*args)`` on ``loop`` (fsspec's loop thread) and wait for it, its failure
    turned into a StorageError as :func:`storage_errors` says."""
    with storage_errors(op, key, error):
        return fsspec.asyn.sync(loop, fn, *args)


def failed(
    op: str,
    where: str,
    e: BaseException,
    attempts: int,
    reason: tuple[str, int] | None = None,
) -> StorageError:
    """The StorageError saying that ``op`` on ``where`` failed because of ``e``, after
    ``attempts`` tries. ``reason`` is what the store's error means, in words, and the errno
    that says it; without one, the words are the error's first line and the errno that of
    the first OSError in its chain (ETIMEDOUT for a timeout, EIO otherwise). A StorageError
    says what went wrong already: only its path becomes ``where``."""
    if isinstance(e, StorageError):
        return StorageError(str(e), path=where, errno=e.errno)
    if reason is None:
        num = _os_errno(e)
        if num is None:
            num = errno.ETIMEDOUT if isinstance(e, TimeoutError) else errno.EIO
        text = str(e)
        reason = (f"{type(e).__name__}: {text.splitlines()[0] if text else ''}", num)
    msg, num = reason
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    err = StorageError(f"{op} {where} failed{tries}: {msg}", path=where, errno=num)
    err.__cause__ = e
    return err


def _os_errno(e: BaseException) -> int | None:
    """The errno of the first OSError in the chain of ``e``."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and isinstance(cur.errno, int):
            return int(cur.errno)
        cur = cur.__cause__ or cur.__context__
    return None


@contextlib.contextmanager
def storage_errors(
    op: str, key: str, error: Callable[[str, str, BaseException, int], StorageError]
) -> Iterator[None]:
    """Within the block, a StorageError is raised as it is; a :class:`GaveUp` becomes
    ``error(op, key, cause, attempts)`` with the request's own op, key and count; any other
    failure ``error(op, key, e, 1)``. The frames of what it replaces are cleared."""
    try:
        yield
    except StorageError:
        raise
    except GaveUp as e:
        err = error(e.op, e.key, e.cause, e.attempts)
        clear_frames(e)
        raise err from None
    except Exception as e:
        err = error(op, key, e, 1)
        clear_frames(e)
        raise err from None


async def gather_or_cancel(coros: Iterable[Awaitable[Any]]) -> None:
    """Run ``coros`` together; the first failure cancels the others, waits for them to end
    and is raised. Cancelled from outside, it cancels and waits for them all the same."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # cancelled: the tasks go too, and their errors with them
        for e in await settle(tasks):
            clear_frames(e)
        raise
    errors = await settle(tasks)
    if errors:
        # What failed before the others were cancelled, rather than what their cancellation
        # raised, whatever their order in the list.
        before = {id(t.exception()) for t in done if not t.cancelled()}
        first = next((e for e in errors if id(e) in before), errors[0])
        for e in errors:
            if e is not first:
                clear_frames(e)  # not raised, and its frames hold views of the caller's buffers
        raise first


async def settle(tasks: Iterable[asyncio.Task[Any]]) -> list[BaseException]:
    """Cancel those of ``tasks`` still running, wait for all to end, and return the errors
    they ended with (cancellations aside: their frames are cleared). A task keeps its error,
    and with it the frames it went through, until the error is taken from it."""
    tasks = list(tasks)
    me = asyncio.current_task()
    try:
        left = [t for t in tasks if t is not me and not t.done()]
        for t in left:
            t.cancel()
        if left:
            await asyncio.wait(left)
        errors: list[BaseException] = []
        for t in tasks:
            if t is me or not t.done():
                continue
            try:
                t.result()
            except asyncio.CancelledError as e:
                clear_frames(e)
            except BaseException as e:
                errors.append(e)
        return errors
    finally:
        tasks = left = me = None  # type: ignore[assignment]


def clear_frames(e: BaseException | None) -> None:
    """Drop the locals of the finished frames of ``e`` and of every error it leads to: its
    cause and context, and the error an SDK keeps as an attribute (azure-core's
    ``inner_exception``, ``exc_value`` and ``exc_traceback``)."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        for tb in (cur.__traceback__, getattr(cur, "exc_traceback", None)):
            if tb is not None:
                traceback.clear_frames(tb)
        todo += [cur.__cause__, cur.__context__]
        todo += [
            x
            for x in (getattr(cur, a, None) for a in ("inner_exception", "exc_value"))
            if isinstance(x, BaseException)
        ]


def key_under(prefix: str, path: str) -> str:
    """The object key of ``path`` (a root-relative path) under the root's ``prefix``."""
    path = path.strip("/")
    if prefix and path:
        return f"{prefix}/{path}"
    return prefix or path


def split_options(cls: type[Opts], options: Mapping[str, Any]) -> tuple[Opts, dict[str, Any]]:
    """A plugin's own ``storage_options`` out of ``options``, made into ``cls`` (a dataclass
    whose fields are their names), and the rest, for the fsspec filesystem underneath."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    ours = {k: v for k, v in options.items() if k in names}
    return cls(**ours), {k: v for k, v in options.items() if k not in names}


def check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    """Refuse storage option ``name`` unless ``value`` is an int in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"storage option {name!r} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"storage option {name!r} must be {bound}, got {value}")


def check_seconds(name: str, value: object) -> None:
    """Refuse storage option ``name`` unless ``value`` is a number >= 0 (a time, in s)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"storage option {name!r} must be a number >= 0, got {value!r}")
