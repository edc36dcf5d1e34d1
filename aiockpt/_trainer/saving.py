"""The save path: check a save, copy the state into a slab, and send its request."""

from __future__ import annotations

import contextlib
import time
import uuid as uuid_mod
from collections.abc import Mapping
from typing import Any

import anyio

from .._core import format as fmt
from .._core.protocol import DeleteReq, SaveReq, WindowReady
from .._core.windows import cut_windows, least_capacity
from ..errors import (
    CheckpointError,
    DaemonDiedError,
    StagingMemoryError,
    StateChangedError,
)
from . import dist as _dist
from .checks import clean_metadata, clean_metrics
from .client import DaemonClient
from .deleting import deleted_by_rank_0, deleted_everywhere
from .ledger import Emit, Ledger, SaveHandle, check_step_number
from .mirror import DaemonMirror
from .staging import Layout, LayoutCache, Slab, SlabPool, copy_window, sources_match, window_copies
from .state import Flat, Flattener, StaleFlat
from .supervisor import Supervisor


class Saver:
    """Stages saves into the slab pool and hands them to the daemon."""

    def __init__(
        self,
        daemons: Supervisor,
        mirror: DaemonMirror,
        ledger: Ledger,
        emit: Emit,
        *,
        flattener: Flattener,
        layouts: LayoutCache,
        pool: SlabPool,
        skip_unchanged: bool = False,
    ) -> None:
        self._daemons = daemons
        self._skip_unchanged = skip_unchanged
        self._flattener = flattener
        self._layouts = layouts
        self._pool = pool
        self._mirror = mirror
        self._ledger = ledger
        self._emit = emit

    async def save(
        self,
        group: _dist.Group | None,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        overwrite: bool = False,
    ) -> SaveHandle:
        """Snapshot ``state`` and send it to the daemon; see AsyncCheckpointManager.save."""
        handle = SaveHandle(step if isinstance(step, int) else -1, uuid_mod.uuid4().hex)
        t0 = time.monotonic()
        refused: BaseException | None = None
        dtensors: list[Any] = []
        try:  # all input is checked before anything is staged
            if not isinstance(overwrite, bool):
                raise TypeError(f"overwrite must be a bool, not {type(overwrite).__name__}")
            self._ledger.check_step(step, overwrite=overwrite)
            clean = clean_metrics(metrics), clean_metadata(metadata)
            flat = self._flattener.flatten(state)
            dtensors = flat.dtensors
            if group is not None and dtensors:
                _dist.check_meshes(group, dtensors)
        except CheckpointError as e:
            refused = e
        except Exception as e:
            if group is None or group.world_size == 1:
                raise
            refused = e  # every rank must still come to the agreement, and learn of it
        if group is not None:
            # Every rank learns of a refusal, a mismatched step or mismatched DTensors on any
            # rank, and all share rank 0's uuid, which names the save's coordination files.
            try:
                handle.uuid = _dist.agree(group, step, handle.uuid, refused, dtensors)
            except CheckpointError as e:
                refused = e
        self._emit("save.start", uuid=handle.uuid, step=handle.step)
        try:
            if refused is not None:
                raise refused
            nbytes, copied = await self._submit(group, handle, state, flat, *clean, overwrite)
        except BaseException as e:
            if isinstance(e, (OSError, EOFError)) and not isinstance(e, CheckpointError):
                d = self._daemons.current
                code = d.exit_code if d is not None else None
                e = DaemonDiedError(f"the checkpoint daemon is gone: {e}", exit_code=code)
            self._emit("save.exception", uuid=handle.uuid, step=handle.step, error=e)
            raise e
        self._emit(
            "save.staged",
            uuid=handle.uuid,
            step=step,
            duration_s=time.monotonic() - t0,
            nbytes=nbytes,
            copied_nbytes=copied,
        )
        return handle

    async def delete(self, group: _dist.Group | None, step: int, allow_latest: bool) -> None:
        """Delete the committed ``step`` through the daemon; see AsyncCheckpointManager.delete."""
        check_step_number(step)
        if not isinstance(allow_latest, bool):
            raise TypeError(f"allow_latest must be a bool, not {type(allow_latest).__name__}")
        forget = self._ledger.committed.discard
        if group is None or group.world_size == 1:
            await self._delete(step, allow_latest)
        elif self._daemons.hello.local is not None:
            await deleted_everywhere(group, step, allow_latest, self._daemons, forget)
        else:
            await deleted_by_rank_0(group, step, allow_latest, self._delete)
        forget(step)

    async def _delete(self, step: int, allow_latest: bool) -> None:
        d = await self._daemons.live()
        request: Any = d.request  # (DeleteReq is answered by the writer, after the saves)
        await request(DeleteReq, step=step, allow_latest=allow_latest)

    async def _submit(
        self, group: _dist.Group | None, handle: SaveHandle, state: Any, *args: Any
    ) -> tuple[int, int]:
        d = await self._daemons.live()
        try:
            try:
                return await self._send(d, handle, state, *args)
            except _DiedBeforeSent:  # it never got this save: a new daemon does
                d = await self._daemons.live()
                return await self._send(d, handle, state, *args)
        except BaseException as e:
            if group is not None and d.alive:
                # Every rank agreed to save this step: tell the others not to wait for it.
                with anyio.CancelScope(shield=True):
                    why = f"{type(e).__name__}: {e}"
                    await self._daemons.publish_failures([(handle.step, handle.uuid)], why)
            raise

    async def _send(
        self,
        client: DaemonClient,
        handle: SaveHandle,
        state: Any,
        flat: Flat,
        metrics: dict[str, Any],
        metadata: dict[str, Any],
        overwrite: bool = False,
    ) -> tuple[int, int]:
        """Stage ``state`` (flattened as ``flat``) and send it; returns the shard's size and
        the bytes copied.

        Once this returns the state may change and the handle is pending. On an error nothing
        was sent and the step is free again.
        """
        step = handle.step
        self._ledger.in_flight.add(step)
        self._mirror.hold(handle.uuid, flat)
        slab = None
        sent = False
        try:
            flat, layout, slab, windows, unchanged = await self._stage(state, flat, handle.uuid)
            delta = self._mirror.delta(flat, layout)
            req = SaveReq(
                uuid=handle.uuid,
                step=step,
                slab=slab.name if slab is not None else "",
                slab_size=slab.size if slab is not None else 0,
                layout_id=layout.id,
                layout=delta.layout,
                tree=flat.tree,
                metrics=metrics,
                metadata=metadata,
                forget=self._pool.take_forgotten(),
                fragments=delta.fragments,
                forget_fragments=delta.forget_fragments,
                forget_layouts=delta.forget_layouts,
                lease_generation=self._daemons.lease_generation,
                windows=windows,
                # (0: the daemon keeps nothing for a next copy that will not skip)
                copy_gen=slab.gen if slab is not None and self._skip_unchanged else 0,
                unchanged=unchanged,
                overwrite=overwrite,
            )
            if not client.alive:
                raise _DiedBeforeSent(
                    "the checkpoint daemon died during staging", exit_code=client.exit_code
                )
            self._ledger.pending[handle.uuid] = handle
            client.send_save(req)
            sent = True
            self._mirror.sent(req)
            if windows:
                await self._stream(client, handle, flat, layout, windows)
        except BaseException:
            self._ledger.pending.pop(handle.uuid, None)
            if slab is not None and not sent:
                self._pool.release(slab.name)
            self._ledger.in_flight.discard(step)
            raise
        finally:
            self._mirror.release(handle.uuid)
        kept = sum(layout.specs[j].end - layout.specs[j].start for j in unchanged)
        return layout.file_size, layout.file_size - kept

    async def _stream(
        self,
        client: DaemonClient,
        handle: SaveHandle,
        flat: Flat,
        layout: Layout,
        windows: tuple[tuple[int, int], ...],
    ) -> None:
        """Stage a save in windows, two slabs taking turns: each window is copied once the
        daemon has written the one its slab held before. On an error the daemon is told, and
        the save fails."""
        size = self._pool.window_size(layout.file_size)
        assert size is not None
        jobs = window_copies(layout, windows)
        flats: dict[int, Any] = {}
        handle.staging = True
        slabs = await self._pool.acquire_windows(size)
        unsent = list(slabs)  # lent to this save and not sent to the daemon
        index = 0
        try:
            for index, job in enumerate(jobs):
                slab = slabs[index % 2]
                if slab not in unsent:
                    await self._pool.returned(slab)
                    self._check_going(client, handle)
                    self._pool.lend(slab)
                    unsent.append(slab)
                await anyio.to_thread.run_sync(copy_window, slab, job, flat.tensors, flats)
                self._check_going(client, handle)
                client.send_save(WindowReady(handle.uuid, index, slab.name, slab.size))
                unsent.remove(slab)
        except BaseException as e:
            if client.alive and not handle.done():
                with contextlib.suppress(OSError, ValueError):
                    why = f"{type(e).__name__}: {e}"
                    client.send_save(WindowReady(handle.uuid, index, error=why))
            raise
        finally:
            handle.staging = False
            self._pool.close_windows(slabs, unsent)

    @staticmethod
    def _check_going(client: DaemonClient, handle: SaveHandle) -> None:
        """Raise what ended a save still being staged: its failure, or the daemon's death."""
        if handle.done():
            handle.raise_error()
        if not client.alive:
            raise DaemonDiedError(
                "the checkpoint daemon died during staging", exit_code=client.exit_code
            )

    async def _stage(
        self, state: Any, flat: Flat, uuid: str
    ) -> tuple[Flat, Layout, Slab | None, tuple[tuple[int, int], ...], tuple[int, ...]]:
        """The snapshot: copy the state into a slab; or, when the shard is larger than the
        staging memory allows, check it and cut it into windows (copied by :meth:`_stream`).

        A flatten that took cached mappings on trust is checked as it is copied; when it no
        longer fits the state, flatten afresh (which refuses what cannot be saved, naming its
        key path) and copy again.
        """
        while True:
            try:
                layout = self._layouts.get(flat)
                self._mirror.hold(uuid, flat, layout.id)
                size = self._pool.window_size(layout.file_size)
                if size is not None:
                    if not sources_match(layout, flat.tensors, flat.cuda):
                        raise StaleFlat
                    return flat, layout, None, self._windows(layout, size), ()
                slab = await self._pool.acquire(layout.file_size, layout.id)
                try:
                    unchanged = await anyio.to_thread.run_sync(
                        slab.copy_in, layout, flat.tensors, flat.cuda, self._skip_unchanged
                    )
                except BaseException:
                    self._pool.release(slab.name)
                    raise
                return flat, layout, slab, (), unchanged
            except StaleFlat:
                if flat.trusted:
                    raise StateChangedError(
                        "the state changed while it was being copied (is another thread "
                        "modifying it?); nothing was written"
                    ) from None
                flat = self._flattener.flatten(state, trust=False)
                self._mirror.hold(uuid, flat)

    def _windows(self, layout: Layout, size: int) -> tuple[tuple[int, int], ...]:
        """The windows of ``layout``'s shard for windows of ``size`` bytes; a clear error
        when the staging memory is too small for it."""
        base = layout.data_start
        spans = [(base + s.start, base + s.end) for s in layout.specs]
        try:
            return cut_windows(spans, base, layout.file_size, size)
        except ValueError:
            need = least_capacity(spans, base, layout.file_size)
            raise StagingMemoryError(
                f"staging_memory={self._pool.capacity!r} is too small for this state: its "
                f"shard of {layout.file_size} bytes is staged in two windows of {size} bytes "
                f"per save in flight, and its largest piece that cannot be split (a 16 MiB "
                f"block, or the header) is {need} bytes; give at least "
                f"{2 * fmt.align_up(need) * self._pool.max_pending} bytes"
            ) from None


class _DiedBeforeSent(DaemonDiedError):
    """The daemon died (or is dying) before a save was sent to it: the save goes to a new
    daemon instead, once."""
