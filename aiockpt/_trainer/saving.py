"""The save path: check a save, copy the state into a slab, and send its request."""

from __future__ import annotations

import time
import uuid as uuid_mod
from collections.abc import Mapping
from typing import Any

import anyio

from .._core.protocol import SaveReq
from ..errors import CheckpointError, DaemonDiedError, StateChangedError
from . import dist as _dist
from .checks import clean_metadata, clean_metrics
from .client import DaemonClient
from .ledger import Emit, Ledger, SaveHandle
from .mirror import DaemonMirror
from .staging import Layout, LayoutCache, Slab, SlabPool
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
    ) -> None:
        self._daemons = daemons
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
    ) -> SaveHandle:
        """Snapshot ``state`` and send it to the daemon; see AsyncCheckpointManager.save."""
        handle = SaveHandle(step if isinstance(step, int) else -1, uuid_mod.uuid4().hex)
        t0 = time.monotonic()
        refused: BaseException | None = None
        dtensors: list[Any] = []
        try:  # all input is checked before anything is staged
            self._ledger.check_step(step)
            clean = clean_metrics(metrics), clean_metadata(metadata)
            flat = self._flattener.flatten(state)
            dtensors = flat.dtensors
            if group is not None and dtensors:
                _dist.check_meshes(group, dtensors)
        except CheckpointError as e:
            refused = e
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
            nbytes = await self._submit(group, handle, state, flat, *clean)
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
        )
        return handle

    async def _submit(
        self, group: _dist.Group | None, handle: SaveHandle, state: Any, *args: Any
    ) -> int:
        d = await self._daemons.live()
        try:
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
    ) -> int:
        """Stage ``state`` (flattened as ``flat``) and send it; returns the shard's size.

        Once this returns the state may change and the handle is pending. On an error nothing
        was sent and the step is free again.
        """
        step = handle.step
        self._ledger.in_flight.add(step)
        self._mirror.hold(handle.uuid, flat)
        slab = None
        try:
            flat, layout, slab = await self._stage(state, flat, handle.uuid)
            delta = self._mirror.delta(flat, layout)
            req = SaveReq(
                uuid=handle.uuid,
                step=step,
                slab=slab.name,
                slab_size=slab.size,
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
            )
            if not client.alive:
                raise DaemonDiedError(
                    "the checkpoint daemon died during staging", exit_code=client.exit_code
                )
            self._ledger.pending[handle.uuid] = handle
            client.send_save(req)
        except BaseException:
            self._ledger.pending.pop(handle.uuid, None)
            if slab is not None:
                self._pool.release(slab.name)
            self._ledger.in_flight.discard(step)
            raise
        finally:
            self._mirror.release(handle.uuid)
        self._mirror.sent(req)
        return layout.file_size

    async def _stage(self, state: Any, flat: Flat, uuid: str) -> tuple[Flat, Layout, Slab]:
        """The snapshot: copy the state into a slab.

        A flatten that took cached mappings on trust is checked as it is copied; when it no
        longer fits the state, flatten afresh (which refuses what cannot be saved, naming its
        key path) and copy again.
        """
        while True:
            try:
                layout = self._layouts.get(flat)
                self._mirror.hold(uuid, flat, layout.id)
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
                self._mirror.hold(uuid, flat)
