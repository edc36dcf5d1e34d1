"""aiockpt.storage.objects: the retries, the translation of failures and the frame clearing
that the object-store plugins share."""

from __future__ import annotations

import asyncio
import dataclasses
import errno

import fsspec.asyn
import pytest

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
    split_options,
    storage_errors,
)


class Flaky(Exception):
    """A failure the tests call transient."""


@dataclasses.dataclass(frozen=True)
class Retries:
    retries: int
    backoff: float = 0.0
    max_backoff: float = 0.0


def retrier(retries: int) -> Retrier:
    return Retrier(
        Retries(retries), transient=lambda e: isinstance(e, Flaky), where=lambda k: f"x://{k}"
    )


def failing(errors: list[BaseException], value: str = "done"):
    """A request that raises ``errors`` one call after another, then returns ``value``."""
    calls: list[int] = []

    async def fn() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return value

    return fn, calls


def test_transient_errors_are_retried_until_the_request_passes() -> None:
    fn, calls = failing([Flaky(), Flaky()])
    assert asyncio.run(retrier(2).run("read", "k", fn)) == "done"
    assert len(calls) == 3


def test_the_retries_run_out_with_the_last_error_and_the_count() -> None:
    last = Flaky("third")
    fn, calls = failing([Flaky(), Flaky(), last])
    with pytest.raises(GaveUp) as info:
        asyncio.run(retrier(2).run("read", "k", fn))
    assert (info.value.op, info.value.key, info.value.attempts) == ("read", "k", 3)
    assert info.value.cause is last
    assert len(calls) == 3


def test_an_error_that_is_not_transient_is_not_retried() -> None:
    bad = ValueError("no")
    fn, calls = failing([bad])
    with pytest.raises(GaveUp) as info:
        asyncio.run(retrier(5).run("write", "k", fn))
    assert (info.value.cause, info.value.attempts, len(calls)) == (bad, 1, 1)


def test_the_wait_doubles_up_to_its_cap_with_half_of_it_jittered() -> None:
    r = Retrier(Retries(9, 0.1, 1.0), transient=lambda e: True, where=str)
    for attempt, cap in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (8, 1.0)]:
        waits = [r.delay(attempt) for _ in range(200)]
        assert all(cap / 2 <= w <= cap for w in waits)
        assert max(waits) - min(waits) > cap / 10  # jittered, not one value


def as_error(op: str, key: str, e: BaseException, attempts: int) -> StorageError:
    return StorageError(f"{op} {key} after {attempts}: {e}", path=key, errno=errno.EIO)


def test_failures_become_storage_errors_naming_the_request() -> None:
    loop = fsspec.asyn.get_loop()

    async def gave_up() -> None:
        raise GaveUp("stat", "inner/key", Flaky("reset"), 4)

    async def broke() -> None:
        raise ValueError("bad reply")

    async def said() -> None:
        raise StorageError("already said", path="p", errno=errno.ENOENT)

    async def fine(x: int) -> int:
        return x + 1

    assert run_sync(loop, "read", "outer", as_error, fine, 1) == 2
    with pytest.raises(StorageError, match=r"^stat inner/key after 4: reset$") as info:
        run_sync(loop, "read", "outer", as_error, gave_up)
    assert info.value.__suppress_context__
    with pytest.raises(StorageError, match=r"^read outer after 1: bad reply$"):
        run_sync(loop, "read", "outer", as_error, broke)
    with pytest.raises(StorageError, match="^already said$") as info:
        run_sync(loop, "read", "outer", as_error, said)
    assert info.value.errno == errno.ENOENT
    with (
        pytest.raises(StorageError, match=r"^write k after 1: x$"),
        storage_errors("write", "k", as_error),
    ):
        raise ValueError("x")


def test_a_failure_says_what_failed_where_after_how_many_tries_and_why() -> None:
    refused = ConnectionRefusedError(errno.ECONNREFUSED, "refused")
    wrapped = RuntimeError("cannot connect\nwith a long second line")
    wrapped.__cause__ = refused
    err = failed("read", "x://b/k", wrapped, 3)
    assert str(err) == "read x://b/k failed after 3 attempts: RuntimeError: cannot connect"
    assert (err.errno, err.path, err.__cause__) == (errno.ECONNREFUSED, "x://b/k", wrapped)

    err = failed("write", "x://b/k", TimeoutError(), 1)
    assert str(err) == "write x://b/k failed: TimeoutError: "
    assert err.errno == errno.ETIMEDOUT
    assert failed("write", "x://b/k", ValueError("odd"), 1).errno == errno.EIO

    err = failed("stat", "x://b/k", ValueError("404"), 2, ("no such object", errno.ENOENT))
    assert str(err) == "stat x://b/k failed after 2 attempts: no such object"
    assert err.errno == errno.ENOENT

    said = StorageError("the file ends early", path="k", errno=errno.EIO)
    err = failed("read", "x://b/k", said, 5)
    assert (str(err), err.path, err.errno) == ("the file ends early", "x://b/k", errno.EIO)


def test_the_first_failure_cancels_the_rest_and_is_raised() -> None:
    cancelled: list[str] = []
    first = Flaky("first")

    async def fails(delay: float, e: BaseException) -> None:
        await asyncio.sleep(delay)
        raise e

    async def waits(name: str) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    async def main() -> None:
        await gather_or_cancel(
            [waits("a"), fails(0.01, first), waits("b"), fails(0.05, Flaky("later"))]
        )

    with pytest.raises(Flaky) as info:
        asyncio.run(main())
    assert info.value is first
    assert sorted(cancelled) == ["a", "b"]


def test_the_first_failure_wins_over_one_raised_while_cancelling() -> None:
    """A task ahead in the list whose cancellation goes wrong does not hide the failure
    that cancelled it."""
    first = Flaky("first")

    async def cleans_up_badly() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RuntimeError("while cancelling") from None

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise first

    async def main() -> None:
        await gather_or_cancel([cleans_up_badly(), fails()])

    with pytest.raises(Flaky) as info:
        asyncio.run(main())
    assert info.value is first


def test_nothing_to_gather_and_all_passing_return() -> None:
    done: list[int] = []

    async def one(i: int) -> None:
        await asyncio.sleep(0)
        done.append(i)

    async def main() -> None:
        await gather_or_cancel([])
        await gather_or_cancel(one(i) for i in range(5))

    asyncio.run(main())
    assert sorted(done) == [0, 1, 2, 3, 4]


def hold_a_view(buf: bytearray) -> None:
    view = memoryview(buf)  # noqa: F841 - a local of the frame the traceback keeps
    raise Flaky("with a view in its frame")


@pytest.mark.parametrize("how", ["cause", "context", "inner_exception"])
def test_cleared_frames_let_the_buffer_go(how: str) -> None:
    buf = bytearray(16)
    try:
        hold_a_view(buf)
    except Flaky as e:
        held = e
    outer = RuntimeError("wraps it")
    if how == "cause":
        outer.__cause__ = held
    elif how == "context":
        outer.__context__ = held
    else:
        outer.inner_exception = held  # type: ignore[attr-defined] # as azure-core keeps it
    del held
    with pytest.raises(BufferError):
        buf.append(0)  # the view in the frame still holds it
    clear_frames(outer)
    buf.append(0)
    assert len(buf) == 17


@pytest.mark.parametrize(
    ("prefix", "path", "key"),
    [
        ("", "a/b", "a/b"),
        ("run", "a/b", "run/a/b"),
        ("run", "/a/", "run/a"),
        ("run", "", "run"),
        ("", "", ""),
        ("run/x", "/", "run/x"),
    ],
)
def test_key_under(prefix: str, path: str, key: str) -> None:
    assert key_under(prefix, path) == key


@dataclasses.dataclass(frozen=True)
class Opts:
    part_size: int = 8
    retries: int = 3


def test_a_plugins_options_are_split_from_the_filesystems() -> None:
    ours, rest = split_options(Opts, {"retries": 5, "anon": True, "endpoint_url": "x"})
    assert ours == Opts(retries=5)
    assert rest == {"anon": True, "endpoint_url": "x"}
    assert split_options(Opts, {}) == (Opts(), {})


def test_bad_option_values_are_refused_naming_the_option() -> None:
    check_int("n", 5, 1, 5)
    check_int("n", 10**9, 1)
    check_seconds("t", 0)
    check_seconds("t", 0.5)
    with pytest.raises(TypeError, match="'n' must be an int, got True"):
        check_int("n", True, 0, 5)
    with pytest.raises(TypeError, match="'n' must be an int, got 2.0"):
        check_int("n", 2.0, 0, 5)
    with pytest.raises(ValueError, match="'n' must be between 1 and 5, got 6"):
        check_int("n", 6, 1, 5)
    with pytest.raises(ValueError, match="'n' must be at least 1, got 0"):
        check_int("n", 0, 1)
    for bad in (-1, "1", None, False):
        with pytest.raises(ValueError, match="'t' must be a number >= 0"):
            check_seconds("t", bad)
