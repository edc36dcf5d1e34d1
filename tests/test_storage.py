"""The storage registry, and the storage contract on local paths, file:// and memory://."""

from __future__ import annotations

import errno
import mmap
import os
import random
import socket
import subprocess
import sys
import textwrap
import uuid
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from aiockpt.errors import CorruptCheckpointError, StorageError
from aiockpt.storage import (
    FsspecStorage,
    LocalStorage,
    Storage,
    UnsafeFileError,
    open_storage,
    register_storage,
)
from aiockpt.storage import _registry as registry
from aiockpt.storage.testing import StorageContract

MiB = 1024 * 1024

# ------------------------------------------------------------------- the contract


class TestLocalPath(StorageContract):
    writes_in_order = True

    @pytest.fixture
    def storage_factory(self, tmp_path):
        root = str(tmp_path / "root")
        return lambda: open_storage(root)


class TestFileURL(StorageContract):
    writes_in_order = True

    @pytest.fixture
    def storage_factory(self, tmp_path):
        url = f"file://{tmp_path}/root"

        def open_it() -> Storage:
            s = open_storage(url)
            assert isinstance(s, LocalStorage)
            return s

        return open_it


class TestLocalBuffered(StorageContract):
    """LocalStorage without O_DIRECT: the path taken where a filesystem has none."""

    writes_in_order = True

    @pytest.fixture
    def storage_factory(self, tmp_path):
        return lambda: LocalStorage(str(tmp_path / "root"), direct_io=False)


class TestFsspecFile(StorageContract):
    """The generic fsspec implementation, over fsspec's local filesystem."""

    writes_in_order = True

    conditional_create = False  # fsspec's create mode is exists() then write: not offered

    @pytest.fixture
    def storage_factory(self, tmp_path):
        (tmp_path / "root").mkdir()
        return lambda: FsspecStorage(f"file://{tmp_path}/root")


class TestMemory(StorageContract):
    writes_in_order = True
    large_size = 3 * 1024 * 1024 + 5

    @pytest.fixture
    def storage_factory(self):
        url = f"memory://t-{uuid.uuid4().hex}/root"

        def open_it() -> Storage:
            s = open_storage(url)
            assert isinstance(s, FsspecStorage)
            return s

        yield open_it
        fsspec.filesystem("memory").rm(url.split("://")[1].split("/")[0], recursive=True)


class _CheckedMemory(MemoryFileSystem):
    """An fsspec filesystem aiockpt does not know to create exclusively: it stands for every
    filesystem other than the local and memory ones, which get a check before each write."""

    protocol = "aiockptcheckedmem"

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        prefix = f"{cls.protocol}://"
        return MemoryFileSystem._strip_protocol(path.removeprefix(prefix))


class TestFsspecChecked(StorageContract):
    """The generic fsspec implementation where ``"xb"`` is not trusted: ``exists()`` first."""

    writes_in_order = True

    @pytest.fixture
    def storage_factory(self):
        fsspec.register_implementation(_CheckedMemory.protocol, _CheckedMemory, clobber=True)
        url = f"{_CheckedMemory.protocol}://t-{uuid.uuid4().hex}/root"

        def open_it() -> Storage:
            s = FsspecStorage(url)
            assert not s.creates_atomically
            return s

        yield open_it
        fsspec.filesystem(_CheckedMemory.protocol).rm(
            url.split("://")[1].split("/")[0], recursive=True
        )


def test_which_fsspec_filesystems_create_atomically(tmp_path) -> None:
    """ "xb" is trusted on the local and memory filesystems only."""
    assert FsspecStorage(f"file://{tmp_path}").creates_atomically
    assert FsspecStorage(f"memory://t-{uuid.uuid4().hex}").creates_atomically
    fsspec.register_implementation(_CheckedMemory.protocol, _CheckedMemory, clobber=True)
    assert not FsspecStorage(f"{_CheckedMemory.protocol}://x").creates_atomically


def test_a_failed_fsspec_write_leaves_the_file_there_untouched(tmp_path) -> None:
    """The refused write removes nothing: the file it found stays, with its bytes."""
    for storage in (
        FsspecStorage(f"file://{tmp_path}"),
        FsspecStorage(f"{_CheckedMemory.protocol}://t-{uuid.uuid4().hex}"),
    ):
        storage.write_file("f.bin", [memoryview(b"first")])
        with pytest.raises(StorageError) as info:
            storage.write_file("f.bin", [memoryview(b"second, longer")])
        assert info.value.errno == errno.EEXIST
        assert "f.bin" in str(info.value)
        assert storage.read_range("f.bin", 0, storage.size("f.bin")) == b"first"


# ------------------------------------------------------------------- registry


def _factory(url: str, options: dict[str, Any]) -> Storage:
    """A module-level factory: importable by name, as the daemon needs."""
    return LocalStorage(url.split("://", 1)[1], url=url)


def _bad_factory(url: str, options: dict[str, Any]) -> object:
    return object()


def _protocol() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def clean_env(monkeypatch):
    """Registrations write the environment; put it back after the test."""
    monkeypatch.setenv(registry.ENV_VAR, "")


def test_register_storage_in_code(tmp_path, clean_env) -> None:
    proto = _protocol()
    register_storage(proto, _factory)
    assert proto in registry.registered_protocols()
    s = open_storage(f"{proto}://{tmp_path}")
    assert isinstance(s, LocalStorage)
    assert s.root == str(tmp_path)
    # recorded for the daemon process, which inherits the environment
    assert f"{proto}={__name__}:_factory" in os.environ[registry.ENV_VAR]


def test_register_refuses_to_replace_unless_clobber(clean_env) -> None:
    proto = _protocol()
    register_storage(proto, _factory)
    register_storage(proto, _factory)  # the same factory again is fine
    with pytest.raises(ValueError, match="already registered"):
        register_storage(proto, _bad_factory)
    register_storage(proto, _bad_factory, clobber=True)
    with pytest.raises(TypeError, match="does not implement aiockpt.storage.Storage"):
        open_storage(f"{proto}://x")


def test_register_refuses_what_the_daemon_cannot_import(clean_env) -> None:
    with pytest.raises(ValueError, match="cannot be imported by name"):
        register_storage(_protocol(), lambda url, options: _factory(url, options))
    with pytest.raises(ValueError, match="bad protocol name"):
        register_storage("no/slash", _factory)
    with pytest.raises(ValueError, match="module:attr"):
        register_storage(_protocol(), "no_colon")
    with pytest.raises(TypeError, match="not callable"):
        register_storage(_protocol(), 42)  # type: ignore[arg-type]


def test_registration_reaches_a_child_process(tmp_path, clean_env) -> None:
    """What the daemon sees: a fresh interpreter with the environment of its parent."""
    proto = _protocol()
    register_storage(proto, _factory)
    code = f"from aiockpt.storage import open_storage; print(open_storage('{proto}://{tmp_path}'))"
    env = dict(os.environ)
    here = os.path.dirname(__file__)  # so the child can import this module, as a daemon would
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "LocalStorage" in out.stdout


def test_factory_returning_the_wrong_type(clean_env) -> None:
    proto = _protocol()
    register_storage(proto, _bad_factory)
    with pytest.raises(TypeError) as info:
        open_storage(f"{proto}://anything")
    assert proto in str(info.value)
    assert "object" in str(info.value)


def test_missing_s3_plugin_names_what_to_install(monkeypatch) -> None:
    # As if aiockpt-s3 were not installed: no entry point for s3.
    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    monkeypatch.setattr(registry, "_loaded", {})  # forget a plugin another test imported
    for proto in ("s3", "s3a"):
        with pytest.raises(StorageError) as info:
            open_storage(f"{proto}://bucket/run")
        assert "aiockpt-s3" in str(info.value)
        assert "pip install" in str(info.value)


def test_unknown_protocol() -> None:
    with pytest.raises(StorageError, match="no storage knows the protocol 'nosuchproto'"):
        open_storage("nosuchproto://x/y")


def test_local_paths_take_no_options(tmp_path) -> None:
    with pytest.raises(ValueError, match="storage_options"):
        open_storage(str(tmp_path), {"anon": True})


# ------------------------------------------------------------------- local reads


def _file(tmp_path, size: int) -> tuple[LocalStorage, bytes]:
    data = random.Random(size).randbytes(size)
    storage = LocalStorage(str(tmp_path))
    storage.write_file("f.bin", [memoryview(data)])
    return storage, data


@pytest.mark.parametrize(
    ("offset", "length"),
    [
        (0, 40 * MiB + 123),  # pieces read at once, and an unaligned tail through the cache
        (4096, 17 * MiB),  # an aligned offset: two pieces
        (4096, 2 * MiB),  # one piece
        (100, 3 * MiB),  # an unaligned offset: all through the page cache
        (0, 4095),  # too small to go past the cache
    ],
)
def test_local_reads_into_aligned_memory(tmp_path, offset: int, length: int) -> None:
    """Shared memory (page-aligned, as the daemon's segments are) is read with O_DIRECT in
    pieces read several at a time where the read is large and aligned, and the bytes are
    the file's whatever path a part takes."""
    storage, data = _file(tmp_path, 40 * MiB + 123 + 4096)
    mm = mmap.mmap(-1, length + 4096)
    try:
        with memoryview(mm)[:length] as out:
            storage.readinto("f.bin", offset, out)
        assert mm[:length] == data[offset : offset + length]
        assert mm[length:] == bytes(4096)  # nothing written past the buffer
        if length >= 17 * MiB:  # the pieces were read in parallel (where O_DIRECT works)
            assert storage._pool is not None or not storage.direct_io
    finally:
        mm.close()  # no view of it is left
        storage.close()


def test_a_local_read_past_the_end_fails_and_keeps_no_view(tmp_path) -> None:
    """A file shorter than an O_DIRECT read is an EIO naming the byte asked for, and the
    caller's memory can be unmapped at once (a view left to the traceback would stop it)."""
    storage, _ = _file(tmp_path, 20 * MiB)
    mm = mmap.mmap(-1, 24 * MiB)
    try:
        with pytest.raises(StorageError) as info, memoryview(mm) as out:
            storage.readinto("f.bin", 0, out)
        assert info.value.errno == errno.EIO
        assert f"ends before byte {24 * MiB}" in str(info.value)
        del info
    finally:
        mm.close()
        storage.close()


# ------------------------------------------------------------------- entry points


def _install_fake_plugin(where, proto: str, module: str, body: str) -> None:
    """A distribution on sys.path: metadata with one aiockpt.storage entry point."""
    dist = where / f"fake_{module}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-{module}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[aiockpt.storage]\n{proto} = {module}:factory\n")
    (where / f"{module}.py").write_text(textwrap.dedent(body))


def test_entry_point_plugin_is_imported_only_when_used(tmp_path, monkeypatch) -> None:
    proto, module = _protocol(), f"plug_{uuid.uuid4().hex[:8]}"
    _install_fake_plugin(
        tmp_path,
        proto,
        module,
        """
        from aiockpt.storage import LocalStorage

        def factory(url, options):
            return LocalStorage(url.split("://", 1)[1], url=url)
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert proto in registry.registered_protocols()
    open_storage(str(tmp_path / "local"))  # other protocols do not import it
    assert module not in sys.modules
    s = open_storage(f"{proto}://{tmp_path}/r")
    assert module in sys.modules
    assert isinstance(s, LocalStorage)
    assert s.url == f"{proto}://{tmp_path}/r"


def test_entry_point_that_fails_to_import(tmp_path, monkeypatch) -> None:
    proto, module = _protocol(), f"plug_{uuid.uuid4().hex[:8]}"
    _install_fake_plugin(tmp_path, proto, module, "import a_module_that_does_not_exist\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(StorageError) as info:
        open_storage(f"{proto}://x")
    assert f"{module}:factory" in str(info.value)
    assert "a_module_that_does_not_exist" in str(info.value)


def test_entry_point_returning_the_wrong_type(tmp_path, monkeypatch) -> None:
    proto, module = _protocol(), f"plug_{uuid.uuid4().hex[:8]}"
    _install_fake_plugin(tmp_path, proto, module, "def factory(url, options):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match="returned int, which does not implement"):
        open_storage(f"{proto}://x")


def test_s3_entry_point_is_installed_and_lazy() -> None:
    """The aiockpt-s3 distribution registers s3 and s3a without being imported."""
    code = (
        "import sys; from aiockpt.storage import registered_protocols; "
        "p = registered_protocols(); "
        "print('s3' in p, 's3a' in p, 'aiockpt_s3' in sys.modules, 's3fs' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["True", "True", "False", "False"]


# ------------------------------------------------------------------- local: links and files


@pytest.fixture
def linked(tmp_path):
    """A local root whose step directory ``step_2`` is a symbolic link to a directory of
    another run (``other/step_2``, holding a manifest and a shard)."""
    other = tmp_path / "other" / "step_2"
    other.mkdir(parents=True)
    (other / "manifest.json").write_bytes(b"{}")
    (other / "shard.bin").write_bytes(b"theirs")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(other, root / "step_2")
    return LocalStorage(str(root)), other


def test_local_delete_refuses_a_path_under_a_linked_directory(linked) -> None:
    """Deleting through a symbolic link would delete another run's files: refused with ELOOP
    naming the path, and nothing outside the root is touched."""
    storage, other = linked
    for recursive in (False, True):
        with pytest.raises(StorageError) as info:
            storage.delete("step_2/manifest.json", recursive=recursive)
        assert info.value.errno == errno.ELOOP
        assert "step_2/manifest.json" in str(info.value)
        assert "symbolic link" in str(info.value)
    assert sorted(p.name for p in other.iterdir()) == ["manifest.json", "shard.bin"]


def test_local_recursive_delete_of_a_link_removes_the_link_alone(linked, tmp_path) -> None:
    storage, other = linked
    storage.delete("step_2", recursive=True)
    assert not os.path.lexists(os.path.join(storage.root, "step_2"))
    assert sorted(p.name for p in other.iterdir()) == ["manifest.json", "shard.bin"]
    # a link inside a directory that is deleted is unlinked, never followed
    os.makedirs(os.path.join(storage.root, "step_3"))
    os.symlink(other, os.path.join(storage.root, "step_3", "inside"))
    os.symlink(other / "shard.bin", os.path.join(storage.root, "step_3", "file"))
    storage.delete("step_3", recursive=True)
    assert not os.path.lexists(os.path.join(storage.root, "step_3"))
    assert sorted(p.name for p in other.iterdir()) == ["manifest.json", "shard.bin"]


def test_local_reads_refuse_links_and_what_is_not_a_regular_file(linked, tmp_path) -> None:
    """size, read_range and readinto open regular files only, never through a link, and a
    FIFO, a socket or a device fails at once (its open would block, or read forever)."""
    storage, other = linked
    root = storage.root
    os.makedirs(os.path.join(root, "s"))
    os.mkfifo(os.path.join(root, "s", "fifo"))
    os.symlink("/dev/zero", os.path.join(root, "s", "zero"))
    os.symlink(other / "shard.bin", os.path.join(root, "s", "outside"))
    os.makedirs(os.path.join(root, "s", "dir"))
    here = os.getcwd()
    os.chdir(os.path.join(root, "s"))  # a socket's address is short: bind it by its name
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind("sock")
    finally:
        os.chdir(here)
    cases = {
        "s/fifo": (errno.EINVAL, "a FIFO"),
        "s/sock": (errno.EINVAL, "a socket"),
        "s/zero": (errno.ELOOP, "symbolic link"),
        "s/outside": (errno.ELOOP, "symbolic link"),
        "s/dir": (errno.EISDIR, "a directory"),
        "step_2/shard.bin": (errno.ELOOP, "symbolic link"),
    }
    for path, (code, words) in cases.items():
        for call in (
            lambda p=path: storage.size(p),
            lambda p=path: storage.read_range(p, 0, 4),
            lambda p=path: storage.readinto(p, 0, memoryview(bytearray(4))),
        ):
            with pytest.raises(UnsafeFileError) as info:
                call()
            err = info.value
            assert err.errno == code, (path, err)
            assert words in str(err), err
            assert err.path == os.path.join(root, path)
            assert isinstance(err, CorruptCheckpointError)  # what a load reports


def test_local_writes_never_go_through_a_link(linked) -> None:
    """A write into a linked directory, or onto a link, creates nothing elsewhere."""
    storage, other = linked
    with pytest.raises(StorageError) as info:
        storage.write_file("step_2/new.bin", [memoryview(b"x")])
    assert info.value.errno == errno.ELOOP
    os.symlink(other / "elsewhere.bin", os.path.join(storage.root, "dangling"))
    with pytest.raises(StorageError) as info:
        storage.write_file("dangling", [memoryview(b"x")])
    assert info.value.errno == errno.EEXIST
    assert sorted(p.name for p in other.iterdir()) == ["manifest.json", "shard.bin"]


def test_a_local_root_that_is_itself_a_link_is_used_as_given(tmp_path) -> None:
    """The root is the user's to name, through a link or not: only what lies under it must
    not be one."""
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "root")
    storage = LocalStorage(str(tmp_path / "root"))
    storage.makedirs("step_1")
    storage.write_file("step_1/f.bin", [memoryview(b"through the root's link")])
    assert storage.size("step_1/f.bin") == 23
    assert storage.read_range("step_1/f.bin", 0, 7) == b"through"
    storage.delete("step_1", recursive=True)
    assert list(real.iterdir()) == []
