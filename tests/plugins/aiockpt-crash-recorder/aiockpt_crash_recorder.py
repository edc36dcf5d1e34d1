"""A test-only aiockpt storage plugin: aiockpt's own LocalStorage, every file-system call of
which is recorded, for the crash-point checker of tests/crash/.

``crashrec:///abs/root`` (entry point ``crashrec`` of group ``aiockpt.storage``) is served by
:class:`RecordingStorage`: a :class:`~aiockpt.storage.LocalStorage` whose methods run
LocalStorage's own code with its module-level ``os``, ``shutil`` and ``open`` replaced by
proxies that call the real functions and then append what they did to a log. The log is the
file named by the storage option ``log`` or else by the environment variable
``AIOCKPT_CRASH_LOG``; it is shared by every process of a run (the daemons of all ranks, the
trainers' :func:`mark` calls): each operation and its record happen under one lock (a thread
lock and ``flock`` on the log), so the log's order is the order in which they happened.

Two more options serve runs with two writers on one root. ``writer`` names the writer: every
record of the storage carries it (``"writer": name``). ``pause`` (a step directory's name),
``gate`` and ``reached`` (paths) stop the write of a shard in that directory half way: its
first half written, the storage records ``pause``, creates ``reached`` and, without the log's
lock, waits until ``gate`` exists; then it records ``resume`` and writes the rest. That is a
writer frozen in the middle of a shard (SIGSTOP, a slow disk) while another writer works.

Records are JSON lines, ``op`` being one of:

- ``create`` (a new file: its inode and its entry in its parent directory), ``truncate``,
  ``write`` (``offset`` and ``data``, base64), ``fsync`` (of a file), ``fsync_dir``,
  ``rename`` (``os.replace``), ``link``, ``unlink``, ``mkdir``, ``rmdir``: what LocalStorage
  did to the file system, paths relative to the root, with inode numbers (``ino``, and
  ``parent``, the inode of the directory holding the entry);
- ``api``: a Storage call (``write_file``, ``put_atomic``, ``put_if_absent``, ``receive``,
  ``makedirs``, ``delete``) that returned, with the bytes it wrote or the files it deleted,
  after the records of the operations it made (``receive``, a peer replica arriving, holds
  the log's lock while it reads its stream);
- ``hello``: a storage opened, with the root's inode; ``mark``: a line of the caller's (see
  :func:`mark`); ``pause`` and ``resume``: a gated write stopped and went on.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import fcntl
import json
import os
import shutil
import stat
import threading
import time
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

from aiockpt.storage import LocalStorage, _local

ENV = "AIOCKPT_CRASH_LOG"
PROTOCOL = "crashrec"
#: LocalStorage's methods that run with the recording os, shutil and open.
_REBOUND = (
    "write_file",
    "_write_buffer",
    "put_atomic",
    "put_if_absent",
    "receive",
    "makedirs",
    "delete",
)
_HELPERS = ("_fsync_dir", "_write_all")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Log:
    """An append-only JSON-lines file shared by processes; one per path in a process."""

    _open: ClassVar[dict[str, Log]] = {}
    _open_lock = threading.Lock()

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._lock = threading.RLock()
        self._depth = 0

    @classmethod
    def get(cls, path: str) -> Log:
        with cls._open_lock:
            if path not in cls._open:
                cls._open[path] = cls(path)
            return cls._open[path]

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Exclusive use of the log (and so of the recorded file system) among the threads and
        processes of a run; re-entrant."""
        with self._lock:
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """The log's lock let go for a while, however deeply this thread holds it: a writer
        paused mid-call lets the others work meanwhile. Only the thread holding it calls this."""
        depth, self._depth = self._depth, 0
        if depth:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        for _ in range(depth):
            self._lock.release()
        try:
            yield
        finally:
            for _ in range(depth):
                self._lock.acquire()
            if depth:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._depth = depth

    def append(self, record: dict[str, Any]) -> None:
        line = memoryview((json.dumps(record, sort_keys=True) + "\n").encode())
        with self.held():
            while len(line):
                line = line[os.write(self._fd, line) :]


def mark(path: str, **fields: Any) -> None:
    """Append ``{"op": "mark", "pid": ..., **fields}`` to the log at ``path``: the trainer
    says, say, that ``await handle`` of a step has returned."""
    Log.get(path).append({"op": "mark", "pid": os.getpid(), **fields})


class _Recorder:
    """Turns full paths into the root-relative ones of the records."""

    def __init__(self, root: str, log: Log, writer: str | None = None) -> None:
        self.root = root
        self.log = log
        self.writer = {} if writer is None else {"writer": writer}

    def rel(self, full: Any) -> str:
        return os.path.relpath(os.fspath(full), self.root)

    def op(self, kind: str, **fields: Any) -> None:
        self.log.append({"op": kind, "pid": os.getpid(), **self.writer, **fields})

    def parent(self, full: Any) -> int:
        return os.stat(os.path.dirname(os.fspath(full))).st_ino


class _RecordedFile:
    """A file opened for writing by the builtin ``open``, its writes recorded."""

    def __init__(self, f: Any, proxy: _RecordingOs, path: str) -> None:
        self._f = f
        self._proxy = proxy
        self._path = path

    def __enter__(self) -> _RecordedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, data: bytes) -> int:
        offset = self._f.tell()
        n = self._f.write(data)
        rec = self._proxy.rec
        ino = os.fstat(self._f.fileno()).st_ino
        rec.op("write", path=rec.rel(self._path), ino=ino, offset=offset, data=_b64(data[:n]))
        return n

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._proxy.fds.pop(self._f.fileno(), None)
        self._f.close()


class _RecordingOs:
    """The ``os`` LocalStorage sees: the real functions, the changes they make recorded."""

    def __init__(self, rec: _Recorder) -> None:
        self.rec = rec
        self.fds: dict[int, str] = {}  # open descriptors -> their full paths

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _opened(self, path: str, fd: int, existed: bool, truncating: bool) -> None:
        self.fds[fd] = path
        rec = self.rec
        if not existed:
            ino = os.fstat(fd).st_ino
            rec.op("create", path=rec.rel(path), ino=ino, parent=rec.parent(path))
        elif truncating:
            rec.op("truncate", path=rec.rel(path), ino=os.fstat(fd).st_ino, size=0)

    def open(self, path: str, flags: int, mode: int = 0o777) -> int:
        existed = os.path.lexists(path)
        fd = os.open(path, flags, mode)
        if flags & (os.O_CREAT | os.O_TRUNC):
            self._opened(path, fd, existed or not flags & os.O_CREAT, bool(flags & os.O_TRUNC))
        else:
            self.fds[fd] = path
        return fd

    def open_file(self, file: str, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        """The builtin ``open``, recorded when it writes."""
        if not any(c in mode for c in "wax+"):
            return builtins.open(file, mode, *args, **kwargs)
        existed = os.path.lexists(file)
        f = builtins.open(file, mode, *args, **kwargs)  # noqa: SIM115 - closed by the wrapper
        self._opened(file, f.fileno(), existed, "w" in mode)
        return _RecordedFile(f, self, file)

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        n = os.pwrite(fd, data, offset)
        rec = self.rec
        path = rec.rel(self.fds.get(fd, "?"))
        body = bytes(memoryview(data).cast("B")[:n])
        rec.op("write", path=path, ino=os.fstat(fd).st_ino, offset=offset, data=_b64(body))
        return n

    def fsync(self, fd: int) -> None:
        os.fsync(fd)
        st = os.fstat(fd)
        kind = "fsync_dir" if stat.S_ISDIR(st.st_mode) else "fsync"
        self.rec.op(kind, path=self.rec.rel(self.fds.get(fd, "?")), ino=st.st_ino)

    def close(self, fd: int) -> None:
        self.fds.pop(fd, None)
        os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        ino = os.lstat(src).st_ino
        replaced = os.lstat(dst).st_ino if os.path.lexists(dst) else None
        src_parent, dst_parent = self.rec.parent(src), self.rec.parent(dst)
        os.replace(src, dst)
        rel = self.rec.rel
        self.rec.op(
            "rename",
            src=rel(src),
            dst=rel(dst),
            ino=ino,
            replaced=replaced,
            src_parent=src_parent,
            parent=dst_parent,
        )

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst)
        rel = self.rec.rel
        ino = os.lstat(dst).st_ino
        self.rec.op("link", src=rel(src), path=rel(dst), ino=ino, parent=self.rec.parent(dst))

    def _removed(self, kind: str, path: str, remove: Any) -> None:
        ino, parent = os.lstat(path).st_ino, self.rec.parent(path)
        remove(path)
        self.rec.op(kind, path=self.rec.rel(path), ino=ino, parent=parent)

    def unlink(self, path: str) -> None:
        self._removed("unlink", path, os.unlink)

    def rmdir(self, path: str) -> None:
        self._removed("rmdir", path, os.rmdir)

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        os.mkdir(path, mode)
        rec = self.rec
        rec.op("mkdir", path=rec.rel(path), ino=os.stat(path).st_ino, parent=rec.parent(path))

    def makedirs(self, path: str, mode: int = 0o777, exist_ok: bool = False) -> None:
        missing = []
        head = os.path.abspath(path)
        while not os.path.isdir(head):
            missing.append(head)
            head = os.path.dirname(head)
        if not missing and not exist_ok:
            raise FileExistsError(path)
        for d in reversed(missing):
            self.mkdir(d, mode)


class _RecordingShutil:
    """The ``shutil`` LocalStorage sees: ``rmtree`` as recorded unlinks and rmdirs, bottom-up
    in name order."""

    def __init__(self, proxy: _RecordingOs) -> None:
        self._os = proxy

    def __getattr__(self, name: str) -> Any:
        return getattr(shutil, name)

    def rmtree(self, path: str) -> None:
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if os.path.isdir(full) and not os.path.islink(full):
                self.rmtree(full)
            else:
                self._os.unlink(full)
        self._os.rmdir(path)


def _rebind(fn: Any, namespace: dict[str, Any]) -> Any:
    """``fn``'s code with ``namespace`` as its module globals."""
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


class RecordingStorage(LocalStorage):
    """LocalStorage, its file-system operations and its Storage calls recorded to ``log``;
    ``writer``, ``pause``, ``gate`` and ``reached`` as the module says."""

    def __init__(
        self,
        root: str,
        *,
        log: str,
        url: str | None = None,
        writer: str | None = None,
        pause: str | None = None,
        gate: str | None = None,
        reached: str | None = None,
    ) -> None:
        super().__init__(root, url=url)
        if pause is not None and (gate is None or reached is None):
            raise ValueError("crashrec:// 'pause' needs 'gate' and 'reached'")
        self.log = Log.get(log)
        self._rec = _Recorder(self.root, self.log, writer)
        self._pause, self._gate, self._reached = pause, gate, reached
        proxy = _RecordingOs(self._rec)
        namespace = dict(vars(_local))
        namespace.update(os=proxy, shutil=_RecordingShutil(proxy), open=proxy.open_file)
        for name in _HELPERS:
            namespace[name] = _rebind(vars(_local)[name], namespace)
        self._impl = {
            name: types.MethodType(_rebind(getattr(LocalStorage, name), namespace), self)
            for name in _REBOUND
        }
        self._write_buffer = self._impl["_write_buffer"]  # type: ignore[method-assign]
        root_ino = os.stat(self.root).st_ino if os.path.isdir(self.root) else None
        self._rec.op("hello", root_ino=root_ino)

    def _api(self, call: str, path: str, *args: Any, **fields: Any) -> Any:
        with self.log.held():
            result = self._impl[call](path, *args)
            self._rec.op(
                "api",
                call=call,
                path=path,
                **fields,
                **({} if result is None else {"result": result}),
            )
            return result

    def write_file(self, path: str, buffers: Sequence[memoryview]) -> None:
        # Copied first: the pieces may come from an iterator (a save staged in windows).
        pieces = [bytes(memoryview(b).cast("B")) for b in buffers]
        data = b"".join(pieces)
        if self._gated(path):
            self._api("write_file", path, self._halves(data), data=_b64(data))
            return
        self._api("write_file", path, [memoryview(p) for p in pieces], data=_b64(data))

    def _gated(self, path: str) -> bool:
        return (
            self._pause is not None
            and path.startswith(self._pause.rstrip("/") + "/shard_r")
            and not os.path.exists(str(self._gate))
        )

    def _halves(self, data: bytes) -> Iterator[memoryview]:
        """``data`` in two pieces, with the pause between them (see the module doc)."""
        half = len(data) // 2
        yield memoryview(data[:half])
        self._rec.op("pause")
        with open(str(self._reached), "w"):
            pass
        with self.log.released():
            while not os.path.exists(str(self._gate)):
                time.sleep(0.01)
        self._rec.op("resume")
        yield memoryview(data[half:])

    def put_atomic(self, path: str, data: bytes) -> None:
        self._api("put_atomic", path, data, data=_b64(bytes(data)))

    def put_if_absent(self, path: str, data: bytes, *, mode: int | None = None) -> bool:
        # The mode is the file's before its bytes: one call, as the recorded write is.
        with self.log.held():
            result = self._impl["put_if_absent"](path, data, mode=mode)
            data64 = _b64(bytes(data))
            self._rec.op("api", call="put_if_absent", path=path, data=data64, result=result)
            return bool(result)

    def receive(self, path: str, pieces: Iterable[bytes], crc: int) -> bool:
        got: list[bytes] = []

        def kept() -> Iterator[bytes]:
            for piece in pieces:
                got.append(bytes(piece))
                yield piece

        with self.log.held():
            result = self._impl["receive"](path, kept(), crc)
            data = _b64(b"".join(got))
            self._rec.op("api", call="receive", path=path, data=data, result=result)
            return bool(result)

    def makedirs(self, path: str) -> None:
        self._api("makedirs", path)

    def delete(self, path: str, *, recursive: bool = False) -> None:
        with self.log.held():
            full = self._full(path)
            if recursive and os.path.isdir(full):
                objects = sorted(
                    self._rec.rel(os.path.join(d, f)) for d, _, fs in os.walk(full) for f in fs
                )
            else:
                objects = [path] if os.path.lexists(full) else []
            self._impl["delete"](path, recursive=recursive)
            self._rec.op("api", call="delete", path=path, objects=objects)


_OPTIONS = ("writer", "pause", "gate", "reached")


def make_storage(url: str, options: dict[str, Any]) -> RecordingStorage:
    """The factory of ``crashrec://`` URLs; options: ``log`` (else ``$AIOCKPT_CRASH_LOG``),
    and ``writer``, ``pause``, ``gate``, ``reached`` (see the module doc)."""
    options = dict(options)
    log = options.pop("log", None) or os.environ.get(ENV)
    if not log:
        raise ValueError(f"crashrec:// needs a log: the storage option 'log' or ${ENV}")
    extra = {k: options.pop(k) for k in _OPTIONS if k in options}
    if options:
        raise ValueError(
            f"crashrec:// takes only the options 'log', {', '.join(map(repr, _OPTIONS))} "
            f"(got {sorted(options)})"
        )
    _, _, root = url.partition("://")
    return RecordingStorage(root, log=log, url=url, **extra)
