"""The trainer's side of a load: map the bytes the daemon read and restore the state
(:class:`Loader`, which the manager hands each load to)."""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid as uuid_mod
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import torch

from ..._core.protocol import CollectReq, LoadAsk, LoadReply, LoadReq, ReadReq, SlabRef, Wanted
from ...errors import CheckpointError
from ...events import logger
from .. import dist as _dist
from ..ledger import Emit
from ..staging import Layout, LayoutCache, Slab, SlabPool, copy_pairs
from ..state import Flat, Flattener, StaleFlat
from .early import collected, load_fresh, while_read
from .request import Into, Read, Windowed
from .restore import Restored, Target
from .restore_order import plan_restore
from .targets import (
    _check_step,
    _say_left_out,
    init_optimizer_states,
    target_paths,
    wanted_boxes,
)
from .views import _Later, image_views, map_loaded, views
from .windows import _Windows, plan_while


class Loader:
    """Loads a checkpoint as new objects, or in place into existing ones."""

    def __init__(
        self,
        read: Read,
        warm: Callable[[int | None], Awaitable[None]] | None,
        emit: Emit,
        flattener: Flattener,
        layouts: LayoutCache,
        pool: SlabPool,
    ) -> None:
        self._read = read
        self._warm = warm
        self._emit = emit
        self._flattener = flattener
        self._layouts = layouts
        self._pool = pool
        #: The ranks a load agrees with (see AsyncCheckpointManager.open); None: one process.
        self.group: _dist.Group | None = None

    async def load(
        self,
        step: int | None,
        into: Any,
        strict: bool = True,
        keys: tuple[str, ...] | None = None,
        atomic: bool = True,
    ) -> Any:
        """See AsyncCheckpointManager.load."""
        op = uuid_mod.uuid4().hex
        t0 = time.monotonic()
        self._emit("load.start", uuid=op, step=step)
        agreement = _dist.LoadAgreement(self.group, step)
        try:
            if step is not None:
                _check_step(step)
            if into is None:
                reply, result = await load_fresh(self._lending, self._ask(step, select=keys))
                agreement.checked(reply.step)
                agreement.restored(reply.step)  # in step with ranks restoring into a target
            else:
                required = keys is not None
                if keys is None and not strict:
                    keys = target_paths(into)  # what both hold is all that is restored
                if self._warm is not None:
                    # The daemon readies what the load will check while the target is walked
                    # (see WarmReq): that part of a process's first load is hidden behind
                    # flattening the target and making its layout.
                    await self._warm(step)
                asked = Into(step, into, strict, keys, required, atomic)
                reply, result = await self._load_into(asked, agreement)
                agreement.restored(reply.step)
        except BaseException as e:
            raised: BaseException = e
            if isinstance(e, Exception):
                try:
                    agreement.failed(e)  # the other ranks learn of it, and raise too
                except Exception as told:
                    raised = told
            self._emit("load.exception", uuid=op, step=step, error=raised)
            if raised is e:
                raise
            raise raised from e
        self._emit(
            "load.end",
            uuid=op,
            step=reply.step,
            duration_s=time.monotonic() - t0,
            nbytes=reply.nbytes,
            read_nbytes=reply.read_nbytes,
        )
        return result

    def _ask(self, step: int | None, **fields: Any) -> LoadAsk:
        """What this rank's load of ``step`` reads, with ``fields`` (see LoadAsk)."""
        group = self.group
        rank, world_size = (0, 1) if group is None else (group.rank, group.world_size)
        return LoadAsk(step, rank, world_size, **fields)

    def _ask_into(self, asked: Into, wanted: dict[str, Wanted]) -> LoadAsk:
        """What a load into ``asked.into`` reads: the boxes its DTensors want, its keys."""
        return self._ask(
            asked.step,
            wanted=wanted or None,
            select=asked.keys,
            select_required=asked.required,
            asked=None if asked.keys is not None else target_paths(asked.into),
        )

    async def _load_into(
        self, asked: Into, agreement: _dist.LoadAgreement
    ) -> tuple[LoadReply, Any]:
        """Restore into existing objects, reading through a warm staging slab when one fits.

        The slab is the one the next save of this state will use anyway: the daemon reads
        the shard straight into it (no fresh shared memory to fault in) and the copy out
        into the targets is the only other pass over the bytes. The daemon says where the
        tensors will lie before it reads them, so the restore is planned meanwhile (see
        _restore_while_read). Without a cap the load is atomic either way (see
        AsyncCheckpointManager.load).
        """
        into = asked.into
        slab = None
        init_optimizer_states(into)
        flat: Flat | None = None
        layout = None
        try:
            flat = self._flattener.flatten(into, remember=False)
            layout = self._layouts.get(flat)
        except (CheckpointError, StaleFlat):
            pass  # not a savable state: read into a fresh segment instead
        held = {h.name: h for h in flat.dtensors} if flat is not None else {}
        ask = self._ask_into(asked, wanted_boxes(held))
        target = Target(into, held, asked.strict, asked.keys if asked.required else None)
        if layout is not None:
            window = self._pool.window_size(layout.file_size)
            if window is not None:  # staged in windows under staging_memory: loaded so too
                windowed = Windowed.of(ask, window, stream=not asked.atomic)
                return await self._load_windows(windowed, target, agreement)
            slab = await self._pool.acquire(layout.file_size, layout.id)
        early = uuid_mod.uuid4().hex if slab is not None else None
        try:
            reply = await self._lending(
                LoadReq,
                ask=ask,
                slab=SlabRef(slab.name, slab.size) if slab is not None else None,
                early=early,
                image=layout.image if slab is not None and layout is not None else None,
            )
            if reply.segment is not None:  # the slab was too small: read into a new segment
                reply = await collected(self._lending, reply, early or "")
            if reply.pending:
                assert slab is not None
                assert early is not None
                assert layout is not None
                self._pool.reuse_for_load(slab)
                reply, restored = await self._restore_while_read(
                    reply, early, (slab, layout), target, agreement
                )
            else:  # read into a fresh segment: no slab, or one too small
                tensors = map_loaded(reply)
                plan = functools.partial(plan_restore, target, reply.tree, tensors, tensors)
                planned = await anyio.to_thread.run_sync(plan)
                agreement.checked(reply.step)
                restored = await anyio.to_thread.run_sync(planned.finish, copy_pairs)
            _say_left_out(reply, restored, asked.required)
        finally:
            if slab is not None:
                self._pool.release(slab.name)
        return reply, restored.value

    async def _restore_while_read(
        self,
        reply: LoadReply,
        name: str,
        lent: tuple[Slab, Layout],
        target: Target,
        agreement: _dist.LoadAgreement,
    ) -> tuple[LoadReply, Restored]:
        """A load answered early (see LoadReq.early): the restore is planned against views of
        the slab while the daemon reads into it, everything checked and nothing changed, and
        carried out once the daemon says every checksum passed. What is handed over rather
        than copied in place gets a tensor of its own, filled from the slab then. When the
        daemon reads the shard as it lies in the file (LoadReply.image), the views are the
        slab's own views of ``layout``, made once for its saves."""
        slab, layout = lent
        # (own tensor, its source) pairs: the views' first, then those of what is handed
        # over, which may be one of the former.
        fills: tuple[list[Any], list[Any]] = ([], [])

        def plan() -> Any:
            # The save views, for the save after this load (a resumed run's first): made
            # here, while the daemon reads, rather than in that save's stall.
            own = slab.prepare(layout, write=False)
            if reply.image:
                tensors = image_views(layout, own, fills[0])
            else:
                tensors = views(slab.u8, reply.tensors, fills[0])
            fresh = _Later(tensors, fills[1])
            return plan_restore(target, reply.tree, tensors, fresh)

        # A failure is raised once the slab is the trainer's again; nothing was changed.
        collect = functools.partial(self._lending, CollectReq, name=name)
        planned, done = await while_read(collect, plan)
        agreement.checked(reply.step)

        def finish() -> Restored:
            with torch.no_grad():
                for pairs in fills:
                    if pairs:
                        copy_pairs([own for own, _ in pairs], [src for _, src in pairs])
            return planned.finish(copy_pairs)

        restored = await anyio.to_thread.run_sync(finish)
        return dataclasses.replace(reply, read_nbytes=done.read_nbytes, pending=False), restored

    async def _lending(self, kind: type[ReadReq], **fields: Any) -> LoadReply:
        """``self._read(kind, **fields)``, waited for to the end even when cancelled: the
        daemon may be filling a slab the trainer lent it, which must not go back to the pool
        (and to a save's copy) before the daemon is done with it. The cancellation takes
        effect once the answer is in."""
        with anyio.CancelScope(shield=True):
            reply = await self._read(kind, **fields)
        return reply

    async def _load_windows(
        self, windowed: Windowed, target: Target, agreement: _dist.LoadAgreement
    ) -> tuple[LoadReply, Any]:
        """Restore into existing objects through two window slabs of the staging pool, so a
        load stays under ``staging_memory`` as a save does (see _windowed)."""
        slabs = await self._pool.acquire_windows(windowed.window)
        try:
            for slab in slabs:
                self._pool.reuse_for_load(slab)
            reply, restored = await self._windowed(windowed, target, slabs, agreement)
        finally:
            self._pool.close_windows(slabs, list(slabs))
        _say_left_out(reply, restored, windowed.ask.select_required)
        return reply, restored.value

    async def _windowed(
        self,
        windowed: Windowed,
        target: Target,
        slabs: tuple[Slab, Slab],
        agreement: _dist.LoadAgreement,
    ) -> tuple[LoadReply, Restored]:
        """A load whose bytes come a window at a time, the two ``slabs`` taking turns: each
        window is copied into the targets while the daemon reads the next into the other.

        Atomic (not ``stream``), the daemon first reads every window and checks every
        checksum (the target is left untouched if any fails), then reads them again: the
        bytes are read twice. Streamed, each window is read once and checked as it is read,
        so a failure after the first copy leaves the target partly restored. The restore is
        planned while the daemon reads (the checking pass, or the first window), and checks
        everything before the first copy. What a restore hands over rather than copies in
        place (a module's or optimizer's state dict) is read into tensors of its own, as an
        uncapped load's is.
        """
        stream = windowed.stream
        kind, fields = windowed.start(SlabRef(slabs[0].name, slabs[0].size))
        reply = await self._lending(kind, **fields)
        reads = _Windows(self._lending, slabs, windowed, reply)
        if stream:  # planned while the first window is read
            plan, _ = await plan_while(reads.first, reply, target)
            agreement.checked(reply.step)
        else:  # planned while every window is read and checked
            checked = functools.partial(self._lending, CollectReq, name=windowed.name)
            plan, done = await plan_while(checked, reply, target)
            reads.read_nbytes = done.read_nbytes
            agreement.checked(reply.step)
            await reads.first()
        try:
            await reads.copy_into(plan)
            restored = await anyio.to_thread.run_sync(plan.finish)
        except BaseException:
            if reads.copied:  # else nothing was changed
                logger.error(
                    "load(into=) of step %d stopped while copying its windows%s: the target "
                    "may be partly restored",
                    reply.step,
                    "" if stream else ", after every checksum had passed",
                )
            raise
        return dataclasses.replace(reply, read_nbytes=reads.read_nbytes), restored
