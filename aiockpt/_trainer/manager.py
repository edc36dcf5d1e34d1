"""AsyncCheckpointManager and SaveHandle: the trainer side of aiockpt."""

from __future__ import annotations

import _posixshmem
import contextlib
import functools
import itertools
import json
import math
import mmap
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import uuid as uuid_mod
from collections.abc import Generator, Iterable, Mapping
from multiprocessing import Pipe
from typing import Any

import anyio
import torch

from .._core import format as fmt
from .._core.gc import gc_paused, no_gc
from .._core.protocol import (
    PROTOCOL,
    CheckpointInfo,
    CollectPartialsReq,
    EventMsg,
    Hello,
    LoadReply,
    LoadReq,
    PublishFailureReq,
    ReadReq,
    Ready,
    RecordsReq,
    Reply,
    SaveDone,
    SaveReq,
    SlabFree,
    SlabRef,
    StepsReq,
    Stop,
)
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    DaemonDiedError,
    DaemonError,
    DaemonStartError,
    InvalidStepError,
    ManagerClosedError,
    StateChangedError,
    StepExistsError,
    UnsupportedValueError,
)
from ..events import EventDispatcher, EventHandler, entry_point_handlers, process_group_info
from ..retention import CheckpointRecord, RetentionPolicy, best_order
from . import dist as _dist
from .channel import Channel
from .staging import Layout, LayoutCache, Slab, SlabPool, copy_pairs
from .state import ST_TO_TORCH, Flat, Flattener, StaleFlat, load_into, unflatten

__all__ = ["AsyncCheckpointManager", "CheckpointInfo", "SaveHandle"]

DEFAULT_ROOT = "checkpoints"


class SaveHandle:
    """The pending commit of one save. ``await handle`` gives its :class:`CheckpointInfo`."""

    def __init__(self, step: int, uuid: str) -> None:
        self.step = step
        self.uuid = uuid
        self._event = anyio.Event()
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def _resolve(
        self, info: CheckpointInfo | None = None, error: BaseException | None = None
    ) -> None:
        if not self._event.is_set():
            self._info, self._error = info, error
            self._event.set()

    async def wait(self) -> CheckpointInfo:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        assert self._info is not None
        return self._info

    def __await__(self) -> Generator[Any, None, CheckpointInfo]:
        return self.wait().__await__()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "committed")
        return f"<SaveHandle step={self.step} {state}>"


class _Daemon:
    """One running daemon process and its pipe."""

    def __init__(self, proc: subprocess.Popen, chan: Channel) -> None:
        self.proc = proc
        self.chan = chan
        self.alive = True
        self.layouts_sent: set[int] = set()
        #: Ids of the state-tree fragments this daemon holds (see _state.Flattener).
        self.fragments_sent: set[int] = set()
        self.stopping = False
        self.reader_done = anyio.Event()


class AsyncCheckpointManager:
    """Saves and loads checkpoints of a training run through a persistent daemon process.

    Use it as an async context manager; see the README for the API and docs/ for the design.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        max_pending: int = 2,
        retention: RetentionPolicy | None = None,
        event_handlers: Iterable[EventHandler] = (),
        process_group: Any = None,
        start_timeout: float = 60.0,
        close_timeout: float | None = None,
        dist_timeout: float = 300.0,
        on_sigterm: str | None = None,
    ) -> None:
        if root is None:
            root = os.environ.get("AIOCKPT_ROOT") or DEFAULT_ROOT
        self.url = os.fspath(root)
        if not self.url:
            raise ValueError("root must not be empty")
        self.storage_options = dict(storage_options or {})
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, not {max_pending!r}")
        self.max_pending = max_pending
        self.retention = _check_policy(retention)
        if not dist_timeout > 0:
            raise ValueError(f"dist_timeout must be positive, not {dist_timeout!r}")
        self.dist_timeout = float(dist_timeout)
        self._group: _dist.Group | None = None
        self.start_timeout = start_timeout
        self.close_timeout = close_timeout
        if on_sigterm not in (None, "flush"):
            raise ValueError(f"on_sigterm must be None or 'flush', not {on_sigterm!r}")
        self.on_sigterm = on_sigterm
        self._prev_sigterm: Any = None
        self.process_group = process_group
        self._handlers = list(event_handlers)
        self._state = "new"
        self._daemon: _Daemon | None = None
        self._pool = SlabPool(max_pending)
        self._layouts = LayoutCache()
        self._flattener = Flattener()
        #: The flat and layout id of each save between flatten and its request reaching the
        #: daemon, by uuid: what the daemon must not be told to forget yet.
        self._unsent: dict[str, tuple[Flat, int | None]] = {}
        self._retired_fragments: set[int] = set()
        self._retired_layouts: set[int] = set()
        self._pending: dict[str, SaveHandle] = {}
        self._in_flight_steps: set[int] = set()
        self._committed: set[int] = set()
        self._requests: dict[int, tuple[anyio.Event, list[Any]]] = {}
        self._request_ids = itertools.count(1)
        self._spawn_lock = anyio.Lock()
        self._exit_stack: contextlib.AsyncExitStack | None = None
        self.rank = 0
        self.world_size = 1
        self.events = EventDispatcher(self._handlers)

    # ----------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> AsyncCheckpointManager:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        if self._state != "new":
            raise ManagerClosedError(f"the manager is {self._state}; a manager opens once")
        main_thread = threading.current_thread() is threading.main_thread()
        if self.on_sigterm is not None and not main_thread:
            raise RuntimeError(
                "on_sigterm='flush' needs the event loop in the main thread: Python sets signal "
                "handlers only there"
            )
        group_info = process_group_info(self.process_group)  # first: refuses a non-group clearly
        self._group = _dist.resolve_group(self.process_group)
        if self._group is not None:
            self.rank, self.world_size = self._group.rank, self._group.world_size
        self.events = EventDispatcher(
            [*self._handlers, *entry_point_handlers()],
            rank=self.rank,
            world_size=self.world_size,
            process_group=group_info,
        )
        stack = contextlib.AsyncExitStack()
        self._tg = await stack.enter_async_context(anyio.create_task_group())
        self._exit_stack = stack
        try:
            await self._spawn(collect_partials=self._group is None)
            if self._group is not None:
                # One rank removes partial step directories, and only once every rank has
                # started (so none is saving yet) and before any of them may save.
                self._group.barrier()
                if self.rank == 0:
                    await self._request(CollectPartialsReq)
                self._group.barrier()
            self._committed = set(await self._request(StepsReq))
            if self.on_sigterm is not None:
                self._prev_sigterm = signal.getsignal(signal.SIGTERM)
                await self._tg.start(self._watch_sigterm)
        except BaseException:
            self._state = "closed"
            with anyio.CancelScope(shield=True):
                await self._stop_daemon()
            await self._shutdown()
            raise
        self._state = "open"

    async def aclose(self) -> None:
        """Wait for pending saves, stop the daemon, and free every shared-memory segment."""
        if self._state not in ("open", "preempted"):
            self._state = "closed"
            return
        self._state = "closing"
        try:
            with anyio.CancelScope(shield=True):
                if self.close_timeout is None:
                    await self._drain()
                else:
                    with anyio.move_on_after(self.close_timeout):
                        await self._drain()
        finally:
            self._state = "closed"
            with anyio.CancelScope(shield=True):
                await self._stop_daemon()
            await self._shutdown()
            for handle in list(self._pending.values()):
                self._fail(handle, DaemonError("the manager closed before this save committed"))
            self.events.close()  # an operation the daemon never answered still ends

    async def _drain(self) -> None:
        for handle in list(self._pending.values()):
            with contextlib.suppress(Exception):
                await handle.wait()

    async def _stop_daemon(self) -> None:
        d = self._daemon
        if d is not None and d.alive:
            d.stopping = True
            with contextlib.suppress(OSError, ValueError):
                d.chan.send(Stop())
            code = await anyio.to_thread.run_sync(_wait_process, d.proc, 30.0)
            if code is None:
                d.proc.kill()
                await anyio.to_thread.run_sync(d.proc.wait)
            # Its last replies are in the pipe: let the reader deliver them before we go.
            with anyio.move_on_after(10):
                await d.reader_done.wait()
        if d is not None:
            d.chan.close()

    async def _shutdown(self) -> None:
        """Exit the task group (never inside a cancel scope of our own) and free the slabs."""
        if self._exit_stack is not None:
            self._tg.cancel_scope.cancel()
            await self._exit_stack.aclose()
            self._exit_stack = None
        self._pool.close()
        self._restore_sigterm()

    async def _watch_sigterm(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """on_sigterm="flush": on SIGTERM, commit every staged save and stop the daemon, then
        hand the signal to the handler the process had before (by default: terminate)."""
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            task_status.started()
            async for _ in signals:
                break
            self._state = "preempted"  # refuse new saves; those already staging finish
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(self.close_timeout or math.inf):
                    # Saves still copying are not pending yet: wait for them too.
                    while self._pending or self._in_flight_steps:
                        await self._drain()
                        await anyio.sleep(0.01)
                await self._stop_daemon()
            self._pool.close()
        # The receiver is closed (asyncio leaves SIG_DFL behind): put the old handler back.
        self._restore_sigterm()
        os.kill(os.getpid(), signal.SIGTERM)

    def _restore_sigterm(self) -> None:
        if self._prev_sigterm is not None:
            signal.signal(signal.SIGTERM, self._prev_sigterm)
            self._prev_sigterm = None

    def _check_open(self) -> None:
        if self._state != "open":
            raise ManagerClosedError(
                "the manager is not open; use `async with AsyncCheckpointManager(...)`"
                if self._state == "new"
                else f"the manager is {self._state}"
            )

    # ----------------------------------------------------------------- the daemon

    async def _spawn(self, *, collect_partials: bool = False) -> _Daemon:
        parent, child = Pipe(duplex=True)
        # The daemon imports aiockpt from wherever this process did: put that first on its
        # path, ahead of the working directory that `python -m`/`-c` would search first.
        pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        proc = subprocess.Popen(
            [sys.executable, "-c", _DAEMON_BOOT, pkg_parent, str(child.fileno())],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        child.close()  # else EOF never arrives when the daemon dies
        chan = Channel(parent)
        d = _Daemon(proc, chan)
        try:
            chan.send(
                Hello(
                    url=self.url,
                    storage_options=self.storage_options,
                    retention=self.retention,
                    rank=self.rank,
                    world_size=self.world_size,
                    trainer_pid=os.getpid(),
                    collect_partials=collect_partials,
                    dist_timeout=self.dist_timeout if self.world_size > 1 else None,
                )
            )
            with anyio.fail_after(self.start_timeout):
                ready = await chan.recv()
        except TimeoutError:
            proc.kill()
            await anyio.to_thread.run_sync(proc.wait)
            chan.close()
            raise DaemonStartError(
                f"the daemon did not report READY within {self.start_timeout} s"
            ) from None
        except (EOFError, OSError):
            code = await anyio.to_thread.run_sync(proc.wait)
            chan.close()
            raise DaemonStartError(
                f"the daemon exited with code {code} before it was ready"
            ) from None
        if not isinstance(ready, Ready) or ready.error is not None or ready.protocol != PROTOCOL:
            await anyio.to_thread.run_sync(_wait_process, proc, 10.0)
            if proc.poll() is None:
                proc.kill()
                await anyio.to_thread.run_sync(proc.wait)
            chan.close()
            if isinstance(ready, Ready) and ready.error is not None:
                raise ready.error
            if isinstance(ready, Ready):
                raise DaemonStartError(
                    f"the daemon speaks aiockpt daemon protocol {ready.protocol!r}, this manager "
                    f"speaks {PROTOCOL}: the trainer and the daemon must come from the same "
                    "aiockpt installation"
                )
            raise DaemonStartError(f"the daemon answered {ready!r} instead of READY")
        self._daemon = d
        self._tg.start_soon(self._reader, d)
        self.events.emit("daemon.spawn", where="daemon")
        return d

    async def _live_daemon(self) -> _Daemon:
        async with self._spawn_lock:
            d = self._daemon
            if d is None or not d.alive:
                d = await self._spawn()
                self.events.emit("daemon.restart", where="daemon")
                self._committed = set(await self._request(StepsReq))
            return d

    async def _reader(self, d: _Daemon) -> None:
        while True:
            try:
                msg = await d.chan.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, SlabFree):
                self._pool.release(msg.slab)
            elif isinstance(msg, SaveDone):
                self._save_done(msg)
            elif isinstance(msg, Reply):
                slot = self._requests.pop(msg.id, None)
                if slot is not None:
                    slot[1].append(msg)
                    slot[0].set()
            elif isinstance(msg, EventMsg):
                self.events.emit(msg.name, uuid=msg.uuid, step=msg.step, **msg.fields)
        try:
            await self._daemon_gone(d)
        finally:
            d.reader_done.set()

    async def _daemon_gone(self, d: _Daemon) -> None:
        d.alive = False
        code = await anyio.to_thread.run_sync(_wait_process, d.proc, 10.0)
        self.events.emit("daemon.exit", where="daemon")
        if d.stopping and not self._pending and not self._requests:
            return
        err = DaemonDiedError(
            f"the checkpoint daemon (pid {d.proc.pid}) died with exit code {code}", exit_code=code
        )
        for ev, box in self._requests.values():
            box.append(Reply(-1, error=err))
            ev.set()
        self._requests.clear()
        self._pool.release_all()
        pending = list(self._pending.values())
        if self._group is not None and pending and self._state == "open":
            # Before anyone hears of the failure: this rank's next save() blocks in a
            # collective, so the other ranks must already know not to wait for it.
            await self._publish_failures([(h.step, h.uuid) for h in pending], str(err))
        for handle in pending:
            self._fail(handle, err)

    async def _publish_failures(self, lost: list[tuple[int, str]], why: str) -> None:
        """A new daemon tells the other ranks that the dead one's saves failed, so they stop
        waiting for this rank now rather than at their deadline."""
        with contextlib.suppress(CheckpointError):
            for step, uuid in lost:
                await self._request(PublishFailureReq, step=step, uuid=uuid, message=why)

    def _save_done(self, msg: SaveDone) -> None:
        handle = self._pending.pop(msg.uuid, None)
        if handle is None:
            return
        self._in_flight_steps.discard(handle.step)
        if msg.info is not None:
            self._committed.add(handle.step)
            self._committed.difference_update(msg.deleted)
        if msg.error is not None and msg.info is None:
            self.events.emit("save.exception", uuid=handle.uuid, step=handle.step, error=msg.error)
        else:
            self.events.emit(
                "save.end",
                uuid=handle.uuid,
                step=handle.step,
                nbytes=msg.info.nbytes if msg.info else None,
            )
        handle._resolve(msg.info, msg.error)

    def _fail(self, handle: SaveHandle, err: BaseException) -> None:
        self._pending.pop(handle.uuid, None)
        self._in_flight_steps.discard(handle.step)
        self.events.emit("save.exception", uuid=handle.uuid, step=handle.step, error=err)
        handle._resolve(error=err)

    async def _request(self, kind: type[ReadReq], **fields: Any) -> Any:
        d = self._daemon
        if d is None or not d.alive:
            d = await self._live_daemon()
        rid = next(self._request_ids)
        ev, box = anyio.Event(), []
        self._requests[rid] = (ev, box)
        try:
            d.chan.send(kind(rid, **fields))
        except (OSError, ValueError):
            self._requests.pop(rid, None)
            raise DaemonDiedError(
                "the checkpoint daemon is gone", exit_code=d.proc.poll()
            ) from None
        await ev.wait()
        reply: Reply = box[0]
        if reply.error is not None:
            raise reply.error
        return reply.value

    # ----------------------------------------------------------------- save

    async def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Snapshot ``state`` and start writing it; returns once the state may be mutated."""
        self._check_open()
        handle = SaveHandle(step if isinstance(step, int) else -1, uuid_mod.uuid4().hex)
        t0 = time.monotonic()
        refused: BaseException | None = None
        try:  # all input is checked before anything is staged
            self._check_step(step)
            clean_metrics = _clean_metrics(metrics)
            clean_metadata = _clean_metadata(metadata)
            flat = self._flattener.flatten(state)
        except CheckpointError as e:
            refused = e
        if self._group is not None:
            # Every rank learns of a refusal or a mismatched step on any rank, and all share
            # rank 0's uuid, which names the save's coordination files.
            try:
                handle.uuid = _dist.agree(self._group, step, handle.uuid, refused)
            except CheckpointError as e:
                refused = e
        self.events.emit("save.start", uuid=handle.uuid, step=handle.step)
        try:
            if refused is not None:
                raise refused
            d = await self._live_daemon()
            self._in_flight_steps.add(step)
            self._unsent[handle.uuid] = (flat, None)
            sent = False
            try:
                flat, layout, slab = await self._stage(state, flat, handle.uuid)
                try:
                    send_layout = layout.id not in d.layouts_sent
                    new_fragments = {
                        i: node for i, node in flat.fragments.items() if i not in d.fragments_sent
                    }
                    req = SaveReq(
                        uuid=handle.uuid,
                        step=step,
                        slab=slab.name,
                        slab_size=slab.size,
                        layout_id=layout.id,
                        layout=layout.message() if send_layout else None,
                        tree=flat.tree,
                        metrics=clean_metrics,
                        metadata=clean_metadata,
                        forget=self._pool.take_forgotten(),
                        fragments=new_fragments,
                        **self._forgettable(d),
                    )
                    if not d.alive:
                        raise DaemonDiedError(
                            "the checkpoint daemon died during staging", exit_code=d.proc.poll()
                        )
                    self._pending[handle.uuid] = handle
                    d.chan.send(req)
                    sent = True
                    d.layouts_sent.add(layout.id)
                    d.layouts_sent.difference_update(req.forget_layouts)
                    d.fragments_sent.update(new_fragments)
                    d.fragments_sent.difference_update(req.forget_fragments)
                except BaseException:
                    self._pending.pop(handle.uuid, None)
                    self._pool.release(slab.name)
                    raise
            except BaseException as e:
                self._in_flight_steps.discard(step)
                if self._group is not None and not sent and d.alive:
                    # Every rank agreed to save this step: tell the others not to wait for it.
                    with anyio.CancelScope(shield=True):
                        why = f"{type(e).__name__}: {e}"
                        await self._publish_failures([(step, handle.uuid)], why)
                raise
            finally:
                self._unsent.pop(handle.uuid, None)
        except BaseException as e:
            if isinstance(e, (OSError, EOFError)) and not isinstance(e, CheckpointError):
                e = DaemonDiedError(
                    f"the checkpoint daemon is gone: {e}",
                    exit_code=self._daemon.proc.poll() if self._daemon else None,
                )
            self.events.emit("save.exception", uuid=handle.uuid, step=handle.step, error=e)
            raise e
        self.events.emit(
            "save.staged",
            uuid=handle.uuid,
            step=step,
            duration_s=time.monotonic() - t0,
            nbytes=layout.file_size,
        )
        return handle

    async def _stage(self, state: Any, flat: Flat, uuid: str) -> tuple[Flat, Layout, Slab]:
        """The snapshot: copy the state into a slab.

        A flatten that took cached mappings on trust is checked as it is copied; when it no
        longer fits the state, flatten afresh (which refuses what cannot be saved, naming its
        key path) and copy again.
        """
        while True:
            try:
                layout = self._layouts.get(flat)
                self._unsent[uuid] = (flat, layout.id)
                slab = await self._pool.acquire(layout.file_size, layout.id)
                try:
                    await anyio.to_thread.run_sync(slab.copy_in, layout, flat.tensors, flat.cuda)
                except BaseException:
                    self._pool.release(slab.name)
                    raise
                return flat, layout, slab
            except StaleFlat:
                if flat.trusted:
                    raise StateChangedError(
                        "the state changed while it was being copied (is another thread "
                        "modifying it?); nothing was written"
                    ) from None
                flat = self._flattener.flatten(state, trust=False)
                self._unsent[uuid] = (flat, None)

    def _forgettable(self, d: _Daemon) -> dict[str, tuple[int, ...]]:
        """Fragments and layouts the daemon may drop: retired by the flattener or evicted from
        the layout cache, and not referred to by a save that has not reached the daemon yet."""
        self._retired_fragments.update(self._flattener.take_retired())
        self._retired_layouts.update(self._layouts.take_evicted())
        live_fragments: set[int] = set()
        live_layouts: set[int | None] = set()
        for flat, layout_id in self._unsent.values():
            live_fragments.update(flat.fragments)
            live_layouts.add(layout_id)
        fragments = self._retired_fragments - live_fragments
        layouts = self._retired_layouts - live_layouts
        self._retired_fragments -= fragments
        self._retired_layouts -= layouts
        return {
            "forget_fragments": tuple(sorted(fragments & d.fragments_sent)),
            "forget_layouts": tuple(sorted(layouts & d.layouts_sent)),
        }

    def _check_step(self, step: Any) -> None:
        if isinstance(step, bool) or not isinstance(step, int):
            raise InvalidStepError(f"step must be an int, not {type(step).__name__}")
        if step < 0:
            raise InvalidStepError(f"step must be >= 0, not {step}")
        if step >= 10**12:
            raise InvalidStepError(f"step {step} does not fit the 12-digit step directory names")
        if step in self._committed:
            raise StepExistsError(f"step {step} is already committed in {self.url}")
        if step in self._in_flight_steps:
            raise StepExistsError(f"step {step} is already being saved")

    async def wait(self) -> None:
        """Wait until every pending save has committed; raises the first failure."""
        self._check_open()
        first: BaseException | None = None
        for handle in list(self._pending.values()):
            try:
                await handle.wait()
            except CheckpointError as e:
                first = first or e
        if first is not None:
            raise first

    # ----------------------------------------------------------------- queries and load

    async def steps(self) -> list[int]:
        """Committed steps, ascending."""
        self._check_open()
        return list(await self._request(StepsReq))

    async def latest_step(self) -> int | None:
        steps = await self.steps()
        return steps[-1] if steps else None

    async def best_step(self, metric: str, mode: str = "min") -> int | None:
        """The committed step with the best ``metric`` (None when no checkpoint has it);
        ties go to the newer step, and non-finite values never count as best."""
        self._check_open()
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"metric must be a non-empty str, not {metric!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', not {mode!r}")
        records = [
            CheckpointRecord(r.step, r.created_at, r.metrics)
            for r in await self._request(RecordsReq)
        ]
        order = best_order(records, metric, mode)
        return records[order[0]].step if order else None

    async def load(self, step: int | None = None, *, into: Any = None) -> Any:
        """The state saved at ``step`` (latest committed when None). With ``into``, restore in
        place into its tensors and stateful objects and return it."""
        self._check_open()
        op = uuid_mod.uuid4().hex
        t0 = time.monotonic()
        self.events.emit("load.start", uuid=op, step=step)
        try:
            if step is not None:
                self._check_load_step(step)
            if into is None:
                reply = await self._request(
                    LoadReq, step=step, rank=self.rank, world_size=self.world_size
                )
                with gc_paused():  # 20k fresh views and containers: see gc_paused
                    result = unflatten(reply.tree, _map_loaded(reply))
            else:
                reply, result = await self._load_into(step, into)
        except BaseException as e:
            self.events.emit("load.exception", uuid=op, step=step, error=e)
            raise
        self.events.emit(
            "load.end",
            uuid=op,
            step=reply.step,
            duration_s=time.monotonic() - t0,
            nbytes=reply.nbytes,
        )
        return result

    async def _load_into(self, step: int | None, into: Any) -> tuple[LoadReply, Any]:
        """Restore into existing objects, reading through a warm staging slab when one fits.

        The slab is the one the next save of this state will use anyway: the daemon reads
        the shard straight into it (no fresh shared memory to fault in) and the copy out
        into the targets is the only other pass over the bytes.
        """
        slab = None
        try:
            layout = self._layouts.get(self._flattener.flatten(into, remember=False))
        except (CheckpointError, StaleFlat):
            layout = None  # not a savable state: read into a fresh segment instead
        if layout is not None:
            slab = await self._pool.acquire(layout.file_size, layout.id)
        try:
            reply = await self._request(
                LoadReq,
                step=step,
                rank=self.rank,
                world_size=self.world_size,
                slab=SlabRef(slab.name, slab.size) if slab is not None else None,
            )
            if reply.segment is None:
                assert slab is not None
                self._pool.reuse_for_load(slab)
                tensors = _views(slab.u8, reply.tensors)
                owned = False
            else:
                tensors, owned = _map_loaded(reply), True
            result = await anyio.to_thread.run_sync(
                functools.partial(
                    load_into, into, reply.tree, tensors, owned=owned, copy=copy_pairs
                )
            )
            del tensors
        finally:
            if slab is not None:
                self._pool.release(slab.name)
        return reply, result

    @staticmethod
    def _check_load_step(step: Any) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidStepError(f"step must be a non-negative int or None, not {step!r}")


# --------------------------------------------------------------------------- helpers

#: What the daemon process runs: ``python -c _DAEMON_BOOT PKG_PARENT FD``. A fresh interpreter
#: (spawn, never fork), which never imports the trainer's ``__main__``.
_DAEMON_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); from aiockpt._daemon import main; "
    "sys.exit(main(sys.argv[1:]))"
)


def _wait_process(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _check_policy(policy: Any) -> RetentionPolicy | None:
    if policy is None:
        return None
    if isinstance(policy, type) or not isinstance(policy, RetentionPolicy):
        what = f"the class {policy.__name__}" if isinstance(policy, type) else type(policy).__name__
        raise TypeError(f"retention must be a policy with a keep() method, not {what}")
    try:
        pickle.dumps(policy)
    except Exception as e:
        raise TypeError(
            f"the retention policy {policy!r} cannot be sent to the daemon: {e}"
        ) from None
    # Pickle finds classes by module: the daemon never imports the trainer's __main__.
    stack = [policy]
    while stack:
        p = stack.pop()
        if type(p).__module__ == "__main__":
            raise TypeError(
                f"the retention policy {p!r} is defined in __main__, which the daemon does not "
                "import; define it in an importable module"
            )
        stack.extend(getattr(p, "policies", ()))
    return policy


def _clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str):
            raise UnsupportedValueError(f"metrics/{k!r}", "metric names must be str")
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise UnsupportedValueError(f"metrics/{k}", "a tensor metric must hold one value")
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise UnsupportedValueError(
                f"metrics/{k}", f"metrics must be numbers, not {type(v).__name__}"
            )
        if isinstance(v, float) and not math.isfinite(v):
            v = "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        out[k] = v
    return out


def _clean_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    data = dict(metadata or {})
    try:
        json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnsupportedValueError("metadata", f"metadata must be plain JSON: {e}") from None
    return data


def _map_loaded(reply: LoadReply) -> dict[str, torch.Tensor]:
    """Map the daemon's load segment and view each tensor in it (no copy)."""
    name, size = reply.segment, reply.size
    assert name is not None
    fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
    try:
        mm = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
        _posixshmem.shm_unlink(name)  # the mapping lives on as long as the tensors do
    u8 = torch.frombuffer(mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    return _views(u8, reply.tensors)


@no_gc
def _views(u8: torch.Tensor, specs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each loaded tensor as a view of the bytes the daemon read.

    Tensors of one dtype that lie back to back are cut from one typed view by a single
    split_with_sizes: at 20k tensors, a slice and two views per tensor took 70-120 ms.
    """
    tensors: dict[str, torch.Tensor] = {}
    by_offset = sorted(specs.items(), key=lambda item: item[1][2])
    i, n = 0, len(by_offset)
    while i < n:
        key, (dtype_name, shape, start) = by_offset[i]
        itemsize = fmt.DTYPE_SIZES[dtype_name]
        if start % itemsize:
            raise CorruptCheckpointError(f"tensor {key!r} is not aligned to its item size", key=key)
        sizes = [math.prod(shape)]
        end = start + sizes[0] * itemsize
        j = i + 1
        while j < n and by_offset[j][1][0] == dtype_name and by_offset[j][1][2] == end:
            sizes.append(math.prod(by_offset[j][1][1]))
            end += sizes[-1] * itemsize
            j += 1
        parts = u8[start:end].view(ST_TO_TORCH[dtype_name]).split_with_sizes(sizes)
        for (name, (_, shp, _)), part in zip(by_offset[i:j], parts, strict=True):
            tensors[name] = part if len(shp) == 1 else part.view(shp)
        i = j
    return tensors
