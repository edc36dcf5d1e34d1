"""The contract every Storage must meet, as a pytest test class to subclass.

A plugin proves its storage by subclassing :class:`StorageContract` in its tests and
providing one fixture, ``storage_factory``: a callable that opens a new Storage on the same,
initially empty, root each time it is called (two instances stand for two processes)::

    import pytest
    from aiockpt.storage.testing import StorageContract

    class TestMyStorage(StorageContract):
        @pytest.fixture
        def storage_factory(self, tmp_path):
            return lambda: MyStorage(f"my://{tmp_path}")

Class attributes tune the sizes (``large_size`` should cross the backend's multipart or
chunking threshold). Storages the contract opens are closed after each test.

:class:`Relay` puts a TCP relay in front of a real server (an emulator on 127.0.0.1) for the
tests a contract cannot hold: connections reset, a server that stops in the middle of a
request and comes back, the retries and errors a plugin owes its users then.
"""

from __future__ import annotations

import errno
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from ..errors import StorageError
from ._base import Storage
from ._relay import Relay

__all__ = ["Relay", "StorageContract"]


def _data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


class _CreateContract:
    """The part of :class:`StorageContract` that says a write creates and never replaces
    (see storage/_base.py): kept apart only to keep each class short."""

    #: Bytes of the large file: make it cross the backend's multipart/chunk threshold.
    large_size: int = 9 * 1024 * 1024 + 123
    #: Whether the storage declares ``writes_in_order`` (see storage/_base.py).
    writes_in_order: bool = False

    def _assert_refused_and_unchanged(
        self, storage: Storage, path: str, before: bytes, write: Callable[[], None]
    ) -> None:
        """``write()`` fails with EEXIST naming ``path``; the file still holds ``before``."""
        with pytest.raises(StorageError) as info:
            write()
        err = info.value
        assert err.errno == errno.EEXIST, err
        assert err.path is not None
        assert path in err.path
        assert path in str(err)
        assert storage.size(path) == len(before)
        assert storage.read_range(path, 0, len(before)) == before

    def test_write_never_replaces_a_file(self, storage: Storage) -> None:
        """write_file creates: onto an existing file, small or large (a multipart upload
        where the backend has one), it fails with EEXIST and leaves the file as it was."""
        storage.makedirs("step_1")
        before = _data(5000, seed=1)
        storage.write_file("step_1/f.bin", [memoryview(before)])
        for data in (b"short", _data(self.large_size, seed=2)):
            self._assert_refused_and_unchanged(
                storage,
                "step_1/f.bin",
                before,
                lambda d=data: storage.write_file("step_1/f.bin", [memoryview(d)]),  # type: ignore[misc]
            )
        storage.write_file("step_1/g.bin", [])
        self._assert_refused_and_unchanged(
            storage, "step_1/g.bin", b"", lambda: storage.write_file("step_1/g.bin", [])
        )
        # what failed left nothing of its own in sight (no temporary file, no part)
        assert storage.list_dir("step_1") == ["f.bin", "g.bin"]

    def test_write_never_replaces_a_large_file(self, storage: Storage) -> None:
        """Also when the file there was itself written in parts."""
        before = _data(self.large_size, seed=3)
        storage.write_file("big.bin", [memoryview(before[:4096]), memoryview(before[4096:])])
        self._assert_refused_and_unchanged(
            storage,
            "big.bin",
            before,
            lambda: storage.write_file("big.bin", [memoryview(b"x" * 100)]),
        )

    def test_streamed_write_never_replaces_a_file(self, storage: Storage) -> None:
        """A write taking its pieces from an iterator (``writes_in_order``) creates too: a
        small one (one request where the backend has requests) and a large one (parts)."""
        if not self.writes_in_order:
            return
        storage.makedirs("step_1")
        before = _data(5000, seed=4)
        storage.write_file("step_1/shard.bin", [memoryview(before)])
        for size in (10, self.large_size):
            data = _data(size, seed=size)

            def pieces(data: bytes = data) -> Iterator[memoryview]:
                for start in range(0, len(data), 1 << 20):
                    yield memoryview(data)[start : start + (1 << 20)]

            self._assert_refused_and_unchanged(
                storage,
                "step_1/shard.bin",
                before,
                lambda p=pieces: storage.write_file("step_1/shard.bin", p()),  # type: ignore[misc]
            )
        assert storage.list_dir("step_1") == ["shard.bin"]

    def test_a_deleted_file_can_be_created_again(self, storage: Storage) -> None:
        """A refused write keeps the name taken; once the file is deleted, a write creates
        it afresh."""
        storage.write_file("once.bin", [memoryview(b"first")])
        with pytest.raises(StorageError):
            storage.write_file("once.bin", [memoryview(b"second")])
        storage.delete("once.bin")
        storage.write_file("once.bin", [memoryview(b"third")])
        assert storage.read_range("once.bin", 0, 5) == b"third"


class StorageContract(_CreateContract):
    """Behaviour the daemon relies on. Subclass it and provide ``storage_factory``; set
    ``large_size``, ``conditional_create`` and ``writes_in_order`` as the backend needs."""

    #: Whether the storage offers ``put_if_absent`` (an atomic conditional create).
    conditional_create: bool = True

    @pytest.fixture
    def storage_factory(self) -> Callable[[], Storage]:
        """Override: a zero-argument callable opening the same root afresh each call."""
        raise NotImplementedError("provide a storage_factory fixture opening the same root")

    @pytest.fixture
    def opened(self, storage_factory: Callable[[], Storage]) -> Iterator[Callable[[], Storage]]:
        """``storage_factory``, closing whatever it opened at the end of the test."""
        storages: list[Storage] = []

        def open_one() -> Storage:
            s = storage_factory()
            storages.append(s)
            s.makedirs("")  # as the daemon does before it writes; files go in the root too
            return s

        yield open_one
        for s in storages:
            s.close()

    @pytest.fixture
    def storage(self, opened: Callable[[], Storage]) -> Storage:
        """One storage opened by the factory, for a test to use."""
        s = opened()
        assert isinstance(s, Storage)
        return s

    # ----------------------------------------------------------------- writes

    def test_writes_in_order(self, storage: Storage) -> None:
        """A storage declaring ``writes_in_order`` takes pieces from an iterator, one at a
        time, and holds no view of one once it asks for the next."""
        declared = bool(getattr(storage, "writes_in_order", False))
        assert declared == self.writes_in_order
        if not declared:
            return
        piece = bytearray(self.large_size // 3 + 1)
        want = bytearray()
        asked: list[int] = []

        def pieces() -> Iterator[memoryview]:
            for i in range(3):
                piece[:] = _data(len(piece), seed=i)  # what went before is overwritten
                want.extend(piece)
                asked.append(i)
                yield memoryview(piece)

        storage.makedirs("step_1")
        storage.write_file("step_1/shard.bin", pieces())  # type: ignore[arg-type]
        assert asked == [0, 1, 2]
        assert storage.read_range("step_1/shard.bin", 0, len(want)) == bytes(want)

    def test_round_trip(self, storage: Storage) -> None:
        data = _data(10_000)
        storage.makedirs("step_1")
        storage.write_file("step_1/shard.bin", [memoryview(data)])
        assert storage.size("step_1/shard.bin") == len(data)
        assert storage.read_range("step_1/shard.bin", 0, len(data)) == data
        assert storage.exists("step_1/shard.bin")

    def test_write_streams_many_buffers(self, storage: Storage) -> None:
        pieces = [_data(n, seed=n) for n in (0, 1, 4095, 4096, 70_001, 3)]
        storage.write_file("many.bin", [memoryview(p) for p in pieces])
        whole = b"".join(pieces)
        assert storage.size("many.bin") == len(whole)
        assert storage.read_range("many.bin", 0, len(whole)) == whole

    def test_large_file_round_trip(self, storage: Storage) -> None:
        head, body = _data(4096, seed=1), bytearray(_data(self.large_size, seed=2))
        storage.write_file("large.bin", [memoryview(head), memoryview(body)])
        assert storage.size("large.bin") == len(head) + len(body)
        out = bytearray(len(head) + len(body))
        storage.readinto("large.bin", 0, memoryview(out))
        assert out == head + body

    def test_write_keeps_no_view_of_the_buffers(self, storage: Storage) -> None:
        # The daemon unmaps shared memory after a write: a view kept past the call breaks it.
        buf = bytearray(_data(self.large_size, seed=3))
        view = memoryview(buf)
        storage.write_file("views.bin", [view[:100], view[100:]])
        view.release()
        buf.append(0)  # BufferError if any view of buf is still alive

    def test_empty_file(self, storage: Storage) -> None:
        storage.write_file("empty.bin", [])
        assert storage.exists("empty.bin")
        assert storage.size("empty.bin") == 0
        assert storage.read_range("empty.bin", 0, 0) == b""

    def test_put_atomic(self, storage: Storage) -> None:
        storage.makedirs("step_2")
        storage.put_atomic("step_2/manifest.json", b'{"a": 1, "padding": "' + b"x" * 1000 + b'"}')
        storage.put_atomic("step_2/manifest.json", b'{"a": 2}')
        assert storage.read_range("step_2/manifest.json", 0, 8) == b'{"a": 2}'
        assert storage.size("step_2/manifest.json") == 8
        # no temporary file is left where listings can see it
        assert storage.list_dir("step_2") == ["manifest.json"]

    def test_put_if_absent_creates_once(self, storage: Storage) -> None:
        put = getattr(storage, "put_if_absent", None)
        assert (put is not None) == self.conditional_create
        if put is None:
            return
        storage.makedirs("_lease")
        assert put("_lease/g1.json", b"first") is True
        assert put("_lease/g1.json", b"second") is False
        assert storage.read_range("_lease/g1.json", 0, 5) == b"first"
        assert storage.list_dir("_lease") == ["g1.json"]  # no temporary file left in sight

    def test_put_if_absent_has_one_winner_among_racing_writers(
        self, opened: Callable[[], Storage]
    ) -> None:
        if not self.conditional_create:
            return
        writers = [opened() for _ in range(4)]
        writers[0].makedirs("step_1")
        barrier = threading.Barrier(len(writers))

        def race(i: int) -> bool:
            barrier.wait()
            return bool(writers[i].put_if_absent("step_1/manifest.json", b"%d" % i))  # type: ignore[attr-defined]

        with ThreadPoolExecutor(len(writers)) as pool:
            won = list(pool.map(race, range(len(writers))))
        assert won.count(True) == 1
        winner = won.index(True)
        assert writers[0].read_range("step_1/manifest.json", 0, 1) == b"%d" % winner

    def test_makedirs_is_idempotent(self, storage: Storage) -> None:
        storage.makedirs("a/b")
        storage.makedirs("a/b")
        storage.write_file("a/b/c.bin", [memoryview(b"c")])
        assert storage.list_dir("a") == ["b"]

    # ----------------------------------------------------------------- listing

    def test_list_dir(self, storage: Storage) -> None:
        assert storage.list_dir("") == []
        for name in ("step_2", "step_10", "step_1"):
            storage.makedirs(name)
            storage.write_file(f"{name}/shard.bin", [memoryview(b"x")])
        storage.put_atomic("top.json", b"{}")
        assert storage.list_dir("") == ["step_1", "step_10", "step_2", "top.json"]
        assert storage.list_dir("step_1") == ["shard.bin"]
        assert storage.list_dir("no_such_dir") == []

    def test_list_is_fresh_across_instances(
        self, opened: Callable[[], Storage], storage: Storage
    ) -> None:
        # Another process (another rank's daemon) writes behind this instance's back.
        other = opened()
        assert storage.list_dir("") == []
        assert storage.list_dir("step_5") == []
        other.makedirs("step_5")
        other.write_file("step_5/shard.bin", [memoryview(b"x")])
        other.put_atomic("step_5/manifest.json", b"{}")
        assert storage.list_dir("") == ["step_5"]
        assert storage.list_dir("step_5") == ["manifest.json", "shard.bin"]
        assert storage.exists("step_5/manifest.json")
        other.delete("step_5", recursive=True)
        assert storage.list_dir("") == []
        assert not storage.exists("step_5/manifest.json")

    # ----------------------------------------------------------------- reads

    def test_read_ranges(self, storage: Storage) -> None:
        data = _data(100_000, seed=4)
        storage.write_file("r.bin", [memoryview(data)])
        for start, end in [(0, 1), (1, 2), (4095, 4097), (50_000, 100_000), (99_999, 100_000)]:
            assert storage.read_range("r.bin", start, end) == data[start:end]
        assert storage.read_range("r.bin", 10, 10) == b""

    def test_read_past_the_end_is_an_error(self, storage: Storage) -> None:
        storage.write_file("short.bin", [memoryview(b"0123456789")])
        for start, end in [(5, 11), (10, 20), (100, 200)]:
            with pytest.raises(StorageError) as info:
                storage.read_range("short.bin", start, end)
            assert info.value.errno == errno.EIO
        out = bytearray(11)
        with pytest.raises(StorageError):
            storage.readinto("short.bin", 0, memoryview(out))

    def test_readinto(self, storage: Storage) -> None:
        data = _data(self.large_size, seed=5)
        storage.write_file("into.bin", [memoryview(data)])
        out = bytearray(len(data))
        storage.readinto("into.bin", 0, memoryview(out))
        assert out == data
        # into the middle of a bigger buffer, from an offset
        big = bytearray(b"\xff" * 300)
        storage.readinto("into.bin", 1000, memoryview(big)[100:200])
        assert big[:100] == b"\xff" * 100
        assert big[100:200] == data[1000:1100]
        assert big[200:] == b"\xff" * 100

    # ----------------------------------------------------------------- deletes

    def test_delete_file(self, storage: Storage) -> None:
        storage.write_file("d.bin", [memoryview(b"d")])
        storage.delete("d.bin")
        assert not storage.exists("d.bin")
        assert storage.list_dir("") == []
        storage.delete("d.bin")  # missing is not an error

    def test_delete_recursive(self, storage: Storage) -> None:
        for path in ("s/a.bin", "s/sub/b.bin", "s/sub/deeper/c.bin", "keep/k.bin"):
            storage.makedirs(path.rsplit("/", 1)[0])
            storage.write_file(path, [memoryview(b"z")])
        storage.delete("s", recursive=True)
        assert storage.list_dir("") == ["keep"]
        assert not storage.exists("s")
        assert not storage.exists("s/sub/b.bin")
        assert storage.exists("keep/k.bin")
        storage.delete("s", recursive=True)  # missing is not an error
        storage.delete("never", recursive=True)

    def test_delete_manifest_uncommits(self, storage: Storage) -> None:
        storage.makedirs("step_7")
        storage.write_file("step_7/shard.bin", [memoryview(b"s")])
        storage.put_atomic("step_7/manifest.json", b"{}")
        storage.delete("step_7/manifest.json")
        assert not storage.exists("step_7/manifest.json")
        assert storage.list_dir("step_7") == ["shard.bin"]

    # ----------------------------------------------------------------- errors

    def test_missing_things(self, storage: Storage) -> None:
        assert not storage.exists("missing.bin")
        assert not storage.exists("missing_dir/missing.bin")
        for call in (
            lambda: storage.size("missing.bin"),
            lambda: storage.read_range("missing.bin", 0, 1),
            lambda: storage.read_range("missing.bin", 0, 0),
            lambda: storage.readinto("missing.bin", 0, memoryview(bytearray(4))),
        ):
            with pytest.raises(StorageError) as info:
                call()
            err = info.value
            assert err.errno == errno.ENOENT, err
            assert err.path is not None
            assert "missing.bin" in err.path
            assert "missing.bin" in str(err)
            assert isinstance(err, OSError)
