"""The trainer's connection to one daemon process.

:class:`DaemonClient` is what the manager needs of a daemon: typed requests, sending saves,
whether it is alive, and stopping it. :class:`SubprocessClient` is the real one: it spawns the
daemon, shakes hands, and runs the reader that routes what the daemon sends to the manager's
:class:`DaemonCallbacks`. A test drives the manager against a fake that implements the
protocol, without a subprocess.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from multiprocessing import Pipe
from typing import Any, Protocol, overload

import anyio

from .._core.pipe import PipeEnd
from .._core.protocol import (
    CappedLoadReq,
    CappedWindowReq,
    CollectPartialsReq,
    CollectReq,
    EventMsg,
    Hello,
    LeaseGrant,
    LoadReply,
    LoadReq,
    ProtocolMismatch,
    PublishFailureReq,
    ReadReq,
    Ready,
    RecordsReq,
    Reply,
    SaveDone,
    SaveReq,
    SlabFree,
    StepRecord,
    StepsReq,
    Stop,
    StreamReq,
    StreamWindowReq,
    TierBindReq,
    WarmReq,
    WindowReady,
    check_protocol,
)
from ..errors import DaemonDiedError, DaemonStartError
from .channel import Channel
from .storeproxy import start_relay

#: The requests of a load, one per mode (see _core/protocol/load.py), each answered by a LoadReply.
LoadRequest = LoadReq | CappedLoadReq | CappedWindowReq | StreamReq | StreamWindowReq | CollectReq

#: What the daemon process runs: ``python -c DAEMON_BOOT PKG_PARENT FD``. A fresh interpreter
#: (spawn, never fork), which never imports the trainer's ``__main__``.
DAEMON_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); from aiockpt._daemon import main; "
    "sys.exit(main(sys.argv[1:]))"
)

#: The daemon imports aiockpt from wherever this process did: this goes first on its path,
#: ahead of the working directory that ``python -c`` would search first.
_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True, slots=True)
class DaemonCallbacks:
    """Where a client delivers what its daemon sends, in the order it was sent."""

    #: A slab's bytes are durable (:class:`SlabFree`): its name.
    slab_free: Callable[[str], None]
    #: The end of one save.
    save_done: Callable[[SaveDone], None]
    #: An event made in the daemon.
    event: Callable[[EventMsg], None]
    #: The daemon is gone: the error its outstanding requests failed with, and whether it was
    #: an expected exit (asked to stop, with no request outstanding).
    gone: Callable[[DaemonDiedError, bool], Awaitable[None]]


class DaemonClient(Protocol):
    """One running daemon, as the manager sees it."""

    @property
    def alive(self) -> bool:
        """False once the client knows the daemon is gone."""
        ...

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        ...

    @property
    def exit_code(self) -> int | None:
        """The daemon's exit status, None while it runs."""
        ...

    @property
    def lease(self) -> LeaseGrant | None:
        """The root's lease the daemon took as it started; None when it took none."""
        ...

    @property
    def root_id(self) -> str | None:
        """The root's id as the daemon found (or made) it as it started."""
        ...

    async def serve(self) -> None:
        """Deliver the daemon's messages to the callbacks until it is gone, then call
        ``gone``; the manager runs this as a task for the daemon's lifetime."""
        ...

    @overload
    async def request(self, kind: type[StepsReq]) -> tuple[int, ...]: ...
    @overload
    async def request(self, kind: type[RecordsReq]) -> tuple[StepRecord, ...]: ...
    @overload
    async def request(
        self, kind: type[CollectPartialsReq], *, root: bool = True
    ) -> tuple[int, ...]: ...
    @overload
    async def request(
        self, kind: type[PublishFailureReq], *, step: int, uuid: str, message: str
    ) -> None: ...
    @overload
    async def request(
        self, kind: type[WarmReq], *, step: int | None, rank: int, world_size: int
    ) -> None: ...
    @overload
    async def request(
        self, kind: type[TierBindReq], *, root_id: str, probe: str, role: str = "claim"
    ) -> str: ...
    @overload
    async def request(self, kind: type[LoadRequest], **fields: Any) -> LoadReply: ...
    async def request(self, kind: type[ReadReq], **fields: Any) -> Any:
        """Send ``kind(id, **fields)`` and return its reply's value, or raise its error;
        raises DaemonDiedError when the daemon is gone before it answers."""
        ...

    def send_save(self, req: SaveReq | WindowReady) -> None:
        """Queue a save, or a window of one, for the daemon's writer; raises OSError when
        the pipe is gone."""
        ...

    async def stop(self) -> None:
        """Ask the daemon to finish what is queued and exit; wait for it, and for the reader
        to deliver its last messages."""
        ...


class SubprocessClient:
    """A daemon in a subprocess, over a pipe whose other end it inherited."""

    def __init__(
        self, proc: subprocess.Popen[bytes], chan: Channel, callbacks: DaemonCallbacks
    ) -> None:
        self.proc = proc
        self._chan = chan
        self._callbacks = callbacks
        self._alive = True
        self._stopping = False
        #: Requests sent and not yet answered, by id: the event to set and the reply once set.
        self._requests: dict[int, tuple[anyio.Event, list[Reply]]] = {}
        self._ids = itertools.count(1)
        self._reader_done = anyio.Event()
        self._lease: LeaseGrant | None = None
        self._root_id: str | None = None

    @classmethod
    async def spawn(
        cls,
        hello: Hello,
        callbacks: DaemonCallbacks,
        *,
        start_timeout: float,
        boot: str = DAEMON_BOOT,
        store: Any = None,
    ) -> SubprocessClient:
        """Start a daemon, send it ``hello`` and wait for its :class:`Ready`.

        Raises DaemonStartError when it exits, answers late or speaks another protocol, and
        the error it reports when it could not start. ``boot`` is the program it runs;
        ``store``, the job's c10d store, which a thread of this process relays to the daemon
        for its multi-rank commits (see storeproxy.py).
        """
        parent, child = Pipe(duplex=True)
        inherited = [child]
        if store is not None:
            relay = start_relay(store)
            inherited.append(relay)
            hello = replace(hello, store_fd=relay.fileno())
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", boot, _PKG_PARENT, str(child.fileno())],
                pass_fds=tuple(c.fileno() for c in inherited),
                stdin=subprocess.DEVNULL,
            )
        finally:
            for c in inherited:
                c.close()  # else EOF never arrives when the daemon dies
        chan = Channel(PipeEnd(parent))
        early: list[EventMsg] = []
        try:
            chan.send(hello)
            with anyio.fail_after(start_timeout):
                while isinstance(ready := await chan.recv(), EventMsg):
                    early.append(ready)  # delivered once the client exists
        except TimeoutError:
            proc.kill()
            await anyio.to_thread.run_sync(proc.wait)
            chan.close()
            raise DaemonStartError(
                f"the daemon did not report READY within {start_timeout} s"
            ) from None
        except (EOFError, OSError):
            code = await anyio.to_thread.run_sync(proc.wait)
            chan.close()
            raise DaemonStartError(
                f"the daemon exited with code {code} before it was ready"
            ) from None
        except BaseException:
            # Cancelled while the daemon starts (an open() under a deadline): it may take the
            # root's lease. Stop it as a manager's close would, so that it releases what it
            # took before we return. (Closing the pipe instead would tell it this process is
            # gone, and it would unlink this process's shared memory, some of it other
            # managers'.)
            with anyio.CancelScope(shield=True):
                await _stop_starting(proc, chan, start_timeout)
            raise
        refusal = _refusal(ready)
        if refusal is not None:
            await anyio.to_thread.run_sync(_wait_process, proc, 10.0)
            if proc.poll() is None:
                proc.kill()
                await anyio.to_thread.run_sync(proc.wait)
            chan.close()
            raise refusal
        client = cls(proc, chan, callbacks)
        client._lease = ready.lease if isinstance(ready, Ready) else None
        client._root_id = ready.root_id if isinstance(ready, Ready) else None
        for msg in early:
            callbacks.event(msg)
        return client

    @property
    def alive(self) -> bool:
        """False once the daemon is gone: its pipe closed, or the process exited (seen
        before the reader runs, while the caller's event loop was busy elsewhere), or it is
        dying: killed, exiting, or a zombie not yet reaped (see :func:`dying`)."""
        return self._alive and self.proc.poll() is None and not dying(self.proc.pid)

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        return self.proc.pid

    @property
    def lease(self) -> LeaseGrant | None:
        """The lease the daemon took as it started (see Ready.lease)."""
        return self._lease

    @property
    def root_id(self) -> str | None:
        """The root's id (see Ready.root_id)."""
        return self._root_id

    @property
    def exit_code(self) -> int | None:
        """The daemon's exit status, None while it runs."""
        return self.proc.poll()

    async def serve(self) -> None:
        """The reader: route each message to the callbacks until EOF, then report the death."""
        try:
            while True:
                try:
                    msg = await self._chan.recv()
                except (EOFError, OSError):
                    break
                self._route(msg)
            await self._gone()
        finally:
            self._reader_done.set()

    def _route(self, msg: object) -> None:
        if isinstance(msg, SlabFree):
            self._callbacks.slab_free(msg.slab)
        elif isinstance(msg, SaveDone):
            self._callbacks.save_done(msg)
        elif isinstance(msg, Reply):
            slot = self._requests.pop(msg.id, None)
            if slot is not None:
                slot[1].append(msg)
                slot[0].set()
        elif isinstance(msg, EventMsg):
            self._callbacks.event(msg)

    async def _gone(self) -> None:
        """The pipe closed: fail every outstanding request, then tell the manager."""
        self._alive = False
        code = await anyio.to_thread.run_sync(_wait_process, self.proc, 10.0)
        expected = self._stopping and not self._requests
        err = DaemonDiedError(
            f"the checkpoint daemon (pid {self.proc.pid}) died with exit code {code}",
            exit_code=code,
        )
        for ev, box in self._requests.values():
            box.append(Reply(-1, error=err))
            ev.set()
        self._requests.clear()
        await self._callbacks.gone(err, expected)

    async def request(self, kind: type[ReadReq], **fields: Any) -> Any:
        """Send ``kind(id, **fields)`` and return its reply's value, or raise its error."""
        if not self._alive:  # the reader is done: nothing would answer
            raise DaemonDiedError("the checkpoint daemon is gone", exit_code=self.exit_code)
        rid = next(self._ids)
        ev = anyio.Event()
        box: list[Reply] = []
        self._requests[rid] = (ev, box)
        try:
            self._chan.send(kind(rid, **fields))
        except (OSError, ValueError):
            self._requests.pop(rid, None)
            raise DaemonDiedError(
                "the checkpoint daemon is gone", exit_code=self.exit_code
            ) from None
        await ev.wait()
        reply = box[0]
        if reply.error is not None:
            raise reply.error
        return reply.value

    def send_save(self, req: SaveReq | WindowReady) -> None:
        """Queue a save, or a window of one, for the daemon's writer; raises OSError when
        the pipe is gone."""
        self._chan.send(req)

    async def stop(self) -> None:
        """Ask the daemon to finish what is queued and exit (killing it after 30 s), then let
        the reader deliver its last replies, which are still in the pipe."""
        if self._alive:
            self._stopping = True
            with contextlib.suppress(OSError, ValueError):
                self._chan.send(Stop())
            code = await anyio.to_thread.run_sync(_wait_process, self.proc, 30.0)
            if code is None:
                self.proc.kill()
                await anyio.to_thread.run_sync(self.proc.wait)
            with anyio.move_on_after(10):
                await self._reader_done.wait()
        self._chan.close()


#: SIGKILL's bit in /proc's masks of pending signals; PF_EXITING in /proc/PID/stat's flags.
_SIGKILL_BIT, _PF_EXITING = 1 << (9 - 1), 0x4


def dying(pid: int) -> bool:
    """Whether our child ``pid`` can run no more (Linux; elsewhere False): a SIGKILL is
    pending, it has begun to exit, or it is a zombie. A process SIGKILLed a moment ago (an
    OOM kill) is all of these in turn, before it can be reaped, and reads no more of its
    pipe: a save sent to it would be lost. Read in that order, so no moment is missed."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False  # reaped already (poll() says so), or no /proc
    for line in status.splitlines():
        if line.startswith((b"SigPnd:", b"ShdPnd:")) and int(line.split()[1], 16) & _SIGKILL_BIT:
            return True
    fields = stat.rpartition(b")")[2].split()  # after the command's name, which may hold spaces
    return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & _PF_EXITING)


def _refusal(ready: object) -> BaseException | None:
    """Why the daemon's first message does not let the manager go on, or None."""
    if not isinstance(ready, Ready):
        return DaemonStartError(f"the daemon answered {ready!r} instead of READY")
    if ready.error is not None:
        return ready.error
    try:
        check_protocol(ready.protocol, "daemon")
    except ProtocolMismatch as e:
        return DaemonStartError(str(e))
    return None


async def _stop_starting(proc: subprocess.Popen[bytes], chan: Channel, timeout: float) -> None:
    """Stop a daemon whose start was given up: wait for its READY, send Stop, wait for it to
    exit; kill it if it is not gone within ``timeout``."""
    with anyio.move_on_after(timeout):
        try:
            while isinstance(ready := await chan.recv(), EventMsg):
                pass
            if isinstance(ready, Ready) and ready.error is None:
                chan.send(Stop())
        except (EOFError, OSError):
            pass  # it exited already
    if await anyio.to_thread.run_sync(_wait_process, proc, timeout) is None:
        proc.kill()
        await anyio.to_thread.run_sync(proc.wait)
    chan.close()


def _wait_process(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None
