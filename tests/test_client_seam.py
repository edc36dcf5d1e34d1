"""The manager against daemons of the test's own, through the DaemonClient seam.

``FakeDaemon`` stands in for the daemon process in memory: it records what the manager sends
and answers only when the test says, so each test decides exactly when a save commits, a
slab comes back or the daemon dies. The handshake tests run real subprocesses: the daemon
itself, or a script that answers as a daemon of another protocol would.
"""

from __future__ import annotations

import os
import time
from typing import Any

import anyio
import pytest
import torch

from aiockpt import AsyncCheckpointManager, CheckpointInfo, Event
from aiockpt._core.protocol import (
    PROTOCOL,
    EventMsg,
    Hello,
    PublishFailureReq,
    SaveDone,
    SaveReq,
    StepsReq,
)
from aiockpt._trainer.client import DaemonCallbacks, SubprocessClient
from aiockpt.errors import CheckpointError, DaemonDiedError, DaemonStartError

pytestmark = pytest.mark.anyio

STATE = {"w": torch.arange(8, dtype=torch.float32), "step": 0}


class FakeClient:
    """One fake daemon: what a DaemonClient is, without a process."""

    def __init__(self, daemon: FakeDaemon, hello: Hello, callbacks: DaemonCallbacks) -> None:
        self.daemon = daemon
        self.hello = hello
        self.callbacks = callbacks
        self.pid = 40_000 + len(daemon.clients)
        self.alive = True
        self.exit_code: int | None = None
        self.lease = None
        self.root_id = "0" * 32
        self.saves: list[SaveReq] = []
        self._stopping = False
        self._exited = anyio.Event()
        self._served = anyio.Event()

    async def serve(self) -> None:
        try:
            await self._exited.wait()
            err = DaemonDiedError(
                f"fake daemon died with {self.exit_code}", exit_code=self.exit_code
            )
            await self.callbacks.gone(err, self._stopping)
        finally:
            self._served.set()

    async def request(self, kind: type, **fields: object) -> object:
        if not self.alive:
            raise DaemonDiedError("the fake daemon is gone", exit_code=self.exit_code)
        if kind is StepsReq:
            return tuple(sorted(self.daemon.committed))
        if kind is PublishFailureReq:
            return None
        raise NotImplementedError(kind.__name__)

    def send_save(self, req: SaveReq) -> None:
        if not self.alive:
            raise BrokenPipeError("the fake daemon is gone")
        self.saves.append(req)

    async def stop(self) -> None:
        if self.alive:
            self._stopping = True
            self.die(0)
            await self._served.wait()

    # what the test makes the daemon do

    def commit(self, req: SaveReq) -> None:
        """Write and commit ``req``, as the daemon's writer would: slab first, then the end."""
        self.callbacks.slab_free(req.slab)
        self.daemon.committed.add(req.step)
        info = CheckpointInfo(req.step, f"{self.hello.url}/{req.step}", time.time(), 1, {})
        self.callbacks.save_done(SaveDone(req.uuid, info))

    def die(self, code: int) -> None:
        self.alive, self.exit_code = False, code
        self._exited.set()


class FakeDaemon:
    """The fake daemons of one manager, one per start, and the steps they committed."""

    def __init__(self) -> None:
        self.clients: list[FakeClient] = []
        self.committed: set[int] = set()

    @property
    def current(self) -> FakeClient:
        return self.clients[-1]

    async def connect(self, hello: Hello, callbacks: DaemonCallbacks) -> FakeClient:
        self.clients.append(FakeClient(self, hello, callbacks))
        return self.clients[-1]


class FakeDaemonManager(AsyncCheckpointManager):
    """A manager whose daemons are ``daemon``'s."""

    def __init__(self, daemon: FakeDaemon, root: str, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.daemon = daemon

    async def _connect(self, hello: Hello, callbacks: DaemonCallbacks) -> FakeClient:
        return await self.daemon.connect(hello, callbacks)


class Recorder:
    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, event: Event) -> None:
        self.names.append(event.name)


async def test_a_save_resolves_its_handle_when_the_daemon_commits_it(root):
    daemon = FakeDaemon()
    async with FakeDaemonManager(daemon, root) as mgr:
        handle = await mgr.save(1, STATE, metrics={"loss": float("nan")})
        (req,) = daemon.current.saves
        assert (req.step, req.uuid, req.metrics) == (1, handle.uuid, {"loss": "nan"})
        assert req.layout is not None  # the first save of this state sends its layout
        assert not handle.done()
        daemon.current.commit(req)
        info = await handle
        assert info.step == 1
        assert handle.done()
        # The daemon holds the layout now: the next save of the same state only names it.
        handle = await mgr.save(2, STATE)
        second = daemon.current.saves[1]
        assert second.layout is None
        assert second.layout_id == req.layout_id
        daemon.current.commit(second)
        await handle
        assert await mgr.steps() == [1, 2]


async def test_a_daemon_death_fails_every_pending_save_with_its_exit_code(root):
    daemon = FakeDaemon()
    rec = Recorder()
    async with FakeDaemonManager(daemon, root, event_handlers=[rec], max_pending=2) as mgr:
        first_pid = mgr.daemon_pid
        assert first_pid == daemon.current.pid
        handles = [await mgr.save(step, STATE) for step in (1, 2)]
        daemon.current.die(-9)
        for handle in handles:
            with pytest.raises(DaemonDiedError) as exc:
                await handle
            assert exc.value.exit_code == -9
        assert mgr.daemon_pid is None
        # The next save starts another daemon, which holds nothing yet: it is sent the layout.
        handle = await mgr.save(3, STATE)
        assert len(daemon.clients) == 2
        assert mgr.daemon_pid not in (None, first_pid)
        (req,) = daemon.current.saves
        assert req.layout is not None
        daemon.current.commit(req)
        assert (await handle).step == 3
    assert rec.names.count("save.exception") == 2
    assert rec.names.count("daemon.restart") == 1


async def test_a_save_waits_for_a_slab_the_daemon_has_not_given_back(root):
    daemon = FakeDaemon()
    async with FakeDaemonManager(daemon, root, max_pending=1) as mgr:
        await mgr.save(1, STATE)
        second_staged = anyio.Event()

        async def save_again() -> None:
            await mgr.save(2, STATE)
            second_staged.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(save_again)
            with anyio.move_on_after(0.3):
                await second_staged.wait()
            assert not second_staged.is_set()  # its only slab is still being written
            assert len(daemon.current.saves) == 1
            daemon.current.commit(daemon.current.saves[0])
        assert [r.step for r in daemon.current.saves] == [1, 2]
        daemon.current.commit(daemon.current.saves[1])
        await mgr.wait()


async def test_events_the_daemon_sends_reach_the_handlers(root):
    daemon = FakeDaemon()
    rec = Recorder()
    async with FakeDaemonManager(daemon, root, event_handlers=[rec]) as mgr:
        daemon.current.callbacks.event(EventMsg("retention.delete", None, 7, {}))
        assert "retention.delete" in rec.names
        assert await mgr.steps() == []


# --------------------------------------------------------------------------- real processes


def _boot(body: str) -> str:
    """A daemon program for ``SubprocessClient.spawn``: ``c`` is its end of the pipe."""
    return (
        "import os, sys; sys.path.insert(0, sys.argv[1]); "
        "from multiprocessing.connection import Connection; "
        "from aiockpt._core.protocol import Ready, Reply; "
        f"c = Connection(int(sys.argv[2])); c.recv(); {body}"
    )


#: Answers the handshake as a daemon of protocol 999 would.
OTHER_PROTOCOL = _boot("c.send(Ready(os.getpid(), protocol=999))")
#: Starts, then exits with status 3 on the first request, without answering it.
DIES_ON_REQUEST = _boot("c.send(Ready(os.getpid())); c.recv(); sys.exit(3)")


def _callbacks(gone: list) -> DaemonCallbacks:
    async def on_gone(err: DaemonDiedError, expected: bool) -> None:
        gone.append((err, expected))

    def ignore(msg: object) -> None:
        raise AssertionError(f"unexpected {msg!r}")

    return DaemonCallbacks(slab_free=ignore, save_done=ignore, event=ignore, gone=on_gone)


def _hello(root: str, **fields: object) -> Hello:
    return Hello(url=root, storage_options={}, retention=None, trainer_pid=os.getpid(), **fields)


async def test_a_daemon_of_another_protocol_is_refused_naming_both_versions(root):
    class OtherProtocolManager(AsyncCheckpointManager):
        async def _connect(self, hello, callbacks):
            return await SubprocessClient.spawn(
                hello, callbacks, start_timeout=30, boot=OTHER_PROTOCOL
            )

    with pytest.raises(DaemonStartError) as exc:
        async with OtherProtocolManager(root):
            pass
    assert "protocol 999" in str(exc.value)
    assert f"speaks {PROTOCOL}" in str(exc.value)


async def test_the_daemon_refuses_a_trainer_of_another_protocol_naming_both_versions(root):
    with pytest.raises(CheckpointError) as exc:
        await SubprocessClient.spawn(_hello(root, protocol=999), _callbacks([]), start_timeout=30)
    assert "protocol 999" in str(exc.value)
    assert f"speaks {PROTOCOL}" in str(exc.value)


async def test_a_daemon_exit_fails_the_request_waiting_on_it_with_its_exit_code(root):
    gone: list = []
    client = await SubprocessClient.spawn(
        _hello(root), _callbacks(gone), start_timeout=30, boot=DIES_ON_REQUEST
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(client.serve)
        with pytest.raises(DaemonDiedError) as exc:
            await client.request(StepsReq)
    assert exc.value.exit_code == 3
    assert not client.alive
    assert gone == [(exc.value, False)]  # the manager hears of it, as an unexpected exit
    with pytest.raises(DaemonDiedError):
        await client.request(StepsReq)  # nothing would answer: refused, not left waiting
    await client.stop()
