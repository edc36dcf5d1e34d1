"""The trainer's side of a load: map the bytes the daemon read and restore the state."""

from __future__ import annotations

import _posixshmem
import bisect
import dataclasses
import functools
import math
import mmap
import os
import time
import uuid as uuid_mod
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import torch

from .._core import format as fmt
from .._core.gc import gc_paused, no_gc
from .._core.protocol import LoadReply, SlabRef, TensorAt, Wanted
from ..errors import CheckpointError, CorruptCheckpointError, InvalidStepError
from ..events import logger
from . import dist as _dist
from .ledger import Emit
from .restore_order import plan_restore
from .staging import Layout, LayoutCache, Slab, SlabPool, copy_pairs, typed_views
from .state import (
    ST_TO_TORCH,
    TORCH_TO_ST,
    Flat,
    Flattener,
    Restored,
    StaleFlat,
    _dtensor_type,
    is_stateful,
    unflatten,
)

#: Asks the daemon for this rank's load's bytes: the fields of a LoadReq but its rank and
#: world size (``step``, ``slab``: a slab lent to read into when large enough, else a fresh
#: segment; ``wanted``: the box of each distributed tensor restored into a DTensor, the others
#: read whole; ``select``, ``select_required``: the key paths to read, None for all;
#: ``window``, ``part``: a load in windows).
Read = Callable[..., Awaitable[LoadReply]]


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
                reply, result = await load_fresh(self._lending, step, keys)
                agreement.checked(reply.step)
                agreement.restored(reply.step)  # in step with ranks restoring into a target
            else:
                required = keys is not None
                if keys is None and not strict:
                    keys = target_paths(into)  # what both hold is all that is restored
                if self._warm is not None:
                    # The daemon readies what the load will check while the target is walked
                    # (see WarmReq): 0.1 s of a process's first load at 20k tensors, hidden
                    # behind 0.2 s of flattening the target and making its layout.
                    await self._warm(step)
                reply, result = await self._load_into(
                    step, into, strict, keys, required, atomic, agreement
                )
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

    async def _load_into(
        self,
        step: int | None,
        into: Any,
        strict: bool,
        keys: tuple[str, ...] | None,
        required: bool,
        atomic: bool,
        agreement: _dist.LoadAgreement,
    ) -> tuple[LoadReply, Any]:
        """Restore into existing objects, reading through a warm staging slab when one fits.

        The slab is the one the next save of this state will use anyway: the daemon reads
        the shard straight into it (no fresh shared memory to fault in) and the copy out
        into the targets is the only other pass over the bytes. The daemon says where the
        tensors will lie before it reads them, so the restore is planned meanwhile (see
        _restore_while_read). Without a cap the load is atomic either way (see
        AsyncCheckpointManager.load).
        """
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
        wanted = wanted_boxes(held)
        if layout is not None:
            window = self._pool.window_size(layout.file_size)
            if window is not None:  # staged in windows under staging_memory: loaded so too
                return await self._load_windows(
                    step, into, strict, keys, required, held, wanted, window, atomic, agreement
                )
            slab = await self._pool.acquire(layout.file_size, layout.id)
        early = uuid_mod.uuid4().hex if slab is not None else None
        try:
            reply = await self._lending(
                step=step,
                slab=SlabRef(slab.name, slab.size) if slab is not None else None,
                wanted=wanted or None,
                select=keys,
                select_required=required,
                asked=None if keys is not None else target_paths(into),
                early=early,
                image=layout.image if slab is not None and layout is not None else None,
            )
            scope = keys if required else None
            if reply.segment is not None:  # the slab was too small: read into a new segment
                reply = await collected(self._lending, reply, early or "")
            if reply.pending:
                assert slab is not None
                assert early is not None
                assert layout is not None
                self._pool.reuse_for_load(slab)
                reply, restored = await self._restore_while_read(
                    reply, early, slab, layout, into, held, strict, scope, agreement
                )
            else:  # read into a fresh segment: no slab, or one too small
                tensors = map_loaded(reply)
                plan = functools.partial(
                    plan_restore, into, reply.tree, tensors, tensors, held, strict, scope
                )
                planned = await anyio.to_thread.run_sync(plan)
                agreement.checked(reply.step)
                restored = await anyio.to_thread.run_sync(planned.finish, copy_pairs)
            _say_left_out(reply, restored, required)
        finally:
            if slab is not None:
                self._pool.release(slab.name)
        return reply, restored.value

    async def _restore_while_read(
        self,
        reply: LoadReply,
        name: str,
        slab: Slab,
        layout: Layout,
        into: Any,
        held: dict[str, Any],
        strict: bool,
        scope: tuple[str, ...] | None,
        agreement: _dist.LoadAgreement,
    ) -> tuple[LoadReply, Restored]:
        """A load answered early (see LoadReq.early): the restore is planned against views of
        the slab while the daemon reads into it, everything checked and nothing changed, and
        carried out once the daemon says every checksum passed. What is handed over rather
        than copied in place gets a tensor of its own, filled from the slab then. When the
        daemon reads the shard as it lies in the file (LoadReply.image), the views are the
        slab's own views of ``layout``, made once for its saves."""
        # (own tensor, its source) pairs: the views' first, then those of what is handed
        # over, which may be one of the former.
        fills: tuple[list[Any], list[Any]] = ([], [])

        def plan() -> Any:
            # The save views, for the save after this load (a resumed run's first): 0.13 s
            # at 20k tensors, here while the daemon reads.
            own = slab.prepare(layout, write=False)
            if reply.image:
                tensors = image_views(layout, own, fills[0])
            else:
                tensors = views(slab.u8, reply.tensors, fills[0])
            fresh = _Later(tensors, fills[1])
            return plan_restore(into, reply.tree, tensors, fresh, held, strict, scope)

        # A failure is raised once the slab is the trainer's again; nothing was changed.
        collect = functools.partial(self._lending, step=reply.step, collect=name)
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

    async def _lending(self, **fields: Any) -> LoadReply:
        """``self._read(**fields)``, waited for to the end even when cancelled: the daemon may be
        filling a slab the trainer lent it, which must not go back to the pool (and to a
        save's copy) before the daemon is done with it. The cancellation takes effect
        once the answer is in."""
        with anyio.CancelScope(shield=True):
            reply = await self._read(**fields)
        return reply

    async def _load_windows(
        self,
        step: int | None,
        into: Any,
        strict: bool,
        keys: tuple[str, ...] | None,
        required: bool,
        held: dict[str, Any],
        wanted: dict[str, Wanted],
        window: int,
        atomic: bool,
        agreement: _dist.LoadAgreement,
    ) -> tuple[LoadReply, Any]:
        """Restore into existing objects through two window slabs of the staging pool, so a
        load stays under ``staging_memory`` as a save does (see _windowed)."""
        ask: dict[str, Any] = {"wanted": wanted or None, "select": keys, "window": window}
        ask["select_required"] = required
        ask["asked"] = None if keys is not None else target_paths(into)
        restore = (into, held, strict, keys if required else None)
        slabs = await self._pool.acquire_windows(window)
        try:
            for slab in slabs:
                self._pool.reuse_for_load(slab)
            reply, restored = await self._windowed(
                step, ask, restore, slabs, agreement, stream=not atomic
            )
        finally:
            self._pool.close_windows(slabs, list(slabs))
        _say_left_out(reply, restored, required)
        return reply, restored.value

    async def _windowed(
        self,
        step: int | None,
        ask: dict[str, Any],
        restore: tuple[Any, dict[str, Any], bool, tuple[str, ...] | None],
        slabs: tuple[Slab, Slab],
        agreement: _dist.LoadAgreement,
        stream: bool,
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
        uncapped load's is. ``restore``: what WindowedRestore is planned with but the reply.
        """
        name = uuid_mod.uuid4().hex  # the stream's, or the checking pass's answered early
        ask = {**ask, "stream": name if stream else None}
        first = SlabRef(slabs[0].name, slabs[0].size)
        reply = await self._lending(step=step, slab=first, early=None if stream else name, **ask)
        reads = _Windows(self._lending, slabs, ask, reply)
        if stream:  # planned while the first window is read
            plan, _ = await plan_while(reads.first, reply, *restore)
            agreement.checked(reply.step)
        else:  # planned while every window is read and checked
            checked = functools.partial(self._lending, step=reply.step, collect=name)
            plan, done = await plan_while(checked, reply, *restore)
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


class _Windows:
    """The windows of one load (see Loader._windowed), read by the daemon into ``slabs`` in
    turn: each fetched while the one before is copied out, what failed kept to be raised as
    it is (not in a group), the read's failure first."""

    def __init__(
        self, lending: Read, slabs: tuple[Slab, Slab], ask: dict[str, Any], reply: LoadReply
    ) -> None:
        self._lending, self._slabs, self._ask, self.reply = lending, slabs, ask, reply
        self._refs = [SlabRef(slab.name, slab.size) for slab in slabs]
        self.failed: list[Exception] = []
        self.copied = False
        self.read_nbytes = 0  # the bytes the daemon read for this load, every pass

    async def fetch(self, i: int) -> None:
        slab = self._refs[i % 2]
        try:
            done = await self._lending(step=self.reply.step, slab=slab, part=i, **self._ask)
        except Exception as e:
            self.failed.append(e)
        else:
            self.read_nbytes += done.read_nbytes

    async def first(self) -> None:
        """Fetch window 0; raise what failed."""
        if self.reply.windows:
            await self.fetch(0)
        if self.failed:
            raise self.failed[0]

    async def copy_into(self, plan: WindowedRestore) -> None:
        """Copy every window into ``plan``'s targets, the first fetched already."""
        windows = self.reply.windows
        for i, span in enumerate(windows):
            if self.failed:
                raise self.failed[0]
            async with anyio.create_task_group() as tg:
                if i + 1 < len(windows):
                    tg.start_soon(self.fetch, i + 1)
                try:
                    self.copied = True
                    await anyio.to_thread.run_sync(plan.copy_window, self._slabs[i % 2].u8, span)
                except Exception as e:
                    self.failed.insert(0, e)
        if self.failed:
            raise self.failed[0]


def wanted_boxes(held: dict[str, Any]) -> dict[str, Wanted]:
    """What each DTensor of a target (dtensor.Held, by key path) wants of a load: its dtype,
    global shape and this rank's box (None: it holds none)."""
    return {
        h.name: (
            TORCH_TO_ST[h.tensor.dtype],
            h.shape,
            None if h.chunk is None else (h.chunk.offsets, h.chunk.sizes),
        )
        for h in held.values()
    }


async def plan_while(
    read: Callable[[], Awaitable[Any]],
    reply: LoadReply,
    into: Any,
    held: dict[str, Any],
    strict: bool,
    scope: tuple[str, ...] | None,
) -> tuple[WindowedRestore, Any]:
    """The restore of a load in windows, planned while ``read()`` runs (the checking pass,
    or a streamed load's first window; nothing changes yet), and what ``read`` returned;
    raised, the read's failure first."""
    plan = functools.partial(WindowedRestore, reply, into, held, strict, scope)
    return await while_read(read, plan)


R = TypeVar("R")
W = TypeVar("W")


async def while_read(read: Callable[[], Awaitable[R]], work: Callable[[], W]) -> tuple[W, R]:
    """``work()`` on a worker thread while ``read()`` is awaited (the daemon reading what
    the work prepares for: a restore's plan, a load's values), and both results, once both
    are done; raised, the read's failure first."""
    done: list[W] = []
    got: list[R] = []
    failed: list[Exception] = []

    async def worker() -> None:
        try:
            done.append(await anyio.to_thread.run_sync(work))
        except Exception as e:
            failed.append(e)

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        try:
            got.append(await read())
        except Exception as e:
            failed.insert(0, e)
    if failed:
        raise failed[0]
    if not done or not got:
        # A cancellation reached one of the two and was absorbed on its way (by the thread
        # it waited for, say): the caller's scope is cancelled, so let it see that.
        await anyio.lowlevel.checkpoint_if_cancelled()
        raise RuntimeError("a load's read or its work ended without a result")
    return done[0], got[0]


async def load_fresh(
    lending: Read, step: int | None, keys: tuple[str, ...] | None
) -> tuple[LoadReply, Any]:
    """Load as new objects, in a segment the daemon makes and this process takes over.

    The daemon answers before it reads (LoadReq.early): the segment is mapped and the
    values built while it reads, then handed back once every checksum has passed. What
    must own its memory (a generator's state) is filled then. At 20k tensors, mapping,
    viewing and rebuilding the tree take 60-90 ms, no longer after the read.
    """
    name = uuid_mod.uuid4().hex
    reply = await lending(step=step, select=keys, early=name)
    later: list[tuple[torch.Tensor, torch.Tensor]] = []
    calls: list[Callable[[], object]] = []

    def build() -> Any:
        with gc_paused():  # 20k fresh views and containers: see gc_paused
            return unflatten(reply.tree, map_loaded(reply, later), later=calls)

    built, reply = await while_read(functools.partial(collected, lending, reply, name), build)
    for own, src in later:
        own.copy_(src)
    for call in calls:
        call()
    return reply, built


async def collected(lending: Read, reply: LoadReply, name: str) -> LoadReply:
    """The outcome of load ``name``, answered early: ``reply`` as if answered late."""
    if not reply.pending:
        return reply
    done = await lending(step=reply.step, collect=name)
    return dataclasses.replace(reply, read_nbytes=done.read_nbytes, pending=False)


def _say_left_out(reply: LoadReply, restored: Restored, required: bool) -> None:
    """Warn of what a ``strict=False`` restore left out, if anything."""
    only_saved = [*restored.only_saved, *(reply.left_out if not required else ())]
    if only_saved or restored.only_target:
        logger.warning(
            "load(strict=False) of step %d restored what both hold; not restored "
            "(saved, not in the target): %s; left as they were (in the target, not "
            "saved): %s",
            reply.step,
            sorted(only_saved) or "none",
            list(restored.only_target) or "none",
        )


class WindowedRestore:
    """A restore whose sources come a window at a time (see Loader._load_windows).

    It is planned twice. First against placeholders (views of one meta tensor of the load's
    size, cut where the tensors lie), which checks everything before anything changes and
    says what is copied in place and what is handed over. Tensors handed over, and sources a
    target takes only part of or a non-contiguous target, get tensors of their own, filled
    window by window like the targets copied into in place. Once every window is in, the
    restore is planned again with those tensors as sources and carried out, skipping the
    copies already made. At 20k tensors the placeholders cost what an uncapped load's views
    do (one split per run of tensors), and a window's sources are one split of its bytes.
    """

    @no_gc  # 20k placeholders and spans: see gc_paused
    def __init__(
        self,
        reply: LoadReply,
        into: Any,
        held: dict[str, Any],
        strict: bool,
        scope: tuple[str, ...] | None,
    ) -> None:
        self._into, self._tree, self._held = into, reply.tree, held
        self._strict, self._scope = strict, scope
        self._at = {name: at[2] for name, at in reply.tensors.items()}
        whole = torch.empty(reply.size, dtype=torch.uint8, device="meta")
        self._meta = meta = views(whole, reply.tensors)
        #: name -> a tensor of its own, filled from the windows (see class docstring).
        self._own: dict[str, torch.Tensor] = {}
        # What is handed over gets its own tensor at once, not a placeholder: building the
        # values handed over may look at them (a DTensor's local tensor is moved to its
        # device, an array viewed); their bytes come later.
        self._first = first = plan_restore(
            into, reply.tree, meta, _Asked(self._own_tensor, meta), held, strict, scope
        )
        name_of = _Placeholders(meta, whole, reply.tensors)
        direct: list[tuple[str, torch.Tensor]] = []
        for dst, src in zip(first.dsts, first.srcs, strict=True):
            name = name_of.exactly(src)
            if name is not None and dst.is_contiguous():
                direct.append((name, dst))
            else:
                self._own_tensor(name_of.under(src))
        direct.extend(self._own.items())
        #: (start, end, the destination's bytes) in the load's output, by start.
        self._spans: list[tuple[int, int, torch.Tensor]] = []
        for name, dst in direct:
            if dst.numel():
                start = self._at[name]
                flat = dst if dst.dim() == 1 else dst.view(-1)
                self._spans.append((start, start + dst.nbytes, flat.view(torch.uint8)))
        self._spans.sort(key=lambda item: item[0])
        self._next = 0

    def _own_tensor(self, name: str) -> torch.Tensor:
        """The tensor of its own of ``name``, made the first time (its memory untouched
        until a window fills it)."""
        own = self._own.get(name)
        if own is None:
            m = self._meta[name]
            own = self._own[name] = torch.empty(m.shape, dtype=m.dtype)
        return own

    def copy_window(self, u8: torch.Tensor, span: tuple[int, int]) -> None:
        """Copy the window ``span`` of the load, in ``u8`` from its start, where it goes."""
        a, b = span
        # The sources of spans that follow one another are cut from the window's bytes by
        # one split, the gaps between them included (at 20k tensors, 5 us a slice); a span
        # over bytes already cut (a tensor copied whole and also given its own) is sliced.
        dsts, cut, sliced = [], [], []
        sizes: list[int] = []
        pos = 0
        spans, i = self._spans, self._next
        while i < len(spans) and spans[i][0] < b:
            o, e, dst = spans[i]
            x, y = max(o, a), min(e, b)
            if x < y:
                dsts.append(dst if (o, e) == (x, y) else dst[x - o : y - o])
                if x - a >= pos:
                    if x - a > pos:
                        sizes.append(x - a - pos)
                    cut.append(len(sizes))
                    sizes.append(y - x)
                    pos = y - a
                else:
                    cut.append(-1)
                    sliced.append(u8[x - a : y - a])
            i += 1
        while self._next < len(spans) and spans[self._next][1] <= b:
            self._next += 1
        if dsts:
            parts = u8[:pos].split_with_sizes(sizes) if sizes else []
            others = iter(sliced)
            srcs = [parts[k] if k >= 0 else next(others) for k in cut]
            with torch.no_grad():
                copy_pairs(dsts, srcs)

    def finish(self) -> Restored:
        """The second plan, against the filled tensors, carried out; or the first, when no
        tensor got one of its own (every one was copied in place from the windows and
        nothing is handed over): planning 20k tensors again took 85 ms."""
        if self._own:
            sources = {**self._meta, **self._own}
            args = (self._held, self._strict, self._scope)
            plan = plan_restore(self._into, self._tree, sources, _Handed(self._own), *args)
        else:
            plan = self._first

        def copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
            pairs = [(d, s) for d, s in zip(dsts, srcs, strict=True) if not s.is_meta]
            if pairs:  # the others were copied in place from the windows
                copy_pairs([d for d, _ in pairs], [s for _, s in pairs])

        return plan.finish(copy)


class _Placeholders:
    """Which saved tensor a source of a plan against placeholders (see WindowedRestore) is,
    or is a view of: the placeholder itself by identity, a view of one made on its own (see
    views) by its base, a view of the others by where its bytes lie in the meta tensor they
    are all cut from."""

    def __init__(
        self, meta: dict[str, torch.Tensor], whole: torch.Tensor, specs: dict[str, TensorAt]
    ) -> None:
        self._by_id = {id(t): name for name, t in meta.items()}
        self._storage = whole.untyped_storage()._cdata
        self._specs = specs
        self._by_start: tuple[list[int], list[tuple[int, int, str]]] | None = None

    def exactly(self, src: torch.Tensor) -> str | None:
        """The name of the placeholder ``src`` is, if it is one."""
        return self._by_id.get(id(src))

    def under(self, src: torch.Tensor) -> str:
        """The name of the placeholder ``src`` is a view of."""
        name = self._by_id.get(id(src))
        if name is None and src._base is not None:
            name = self._by_id.get(id(src._base))  # a view of a placeholder made on its own
        if name is not None:
            return name
        same = src.untyped_storage()._cdata == self._storage
        assert same, "a restore's source is not a view of its placeholders"
        if self._by_start is None:  # by start, an empty tensor before one starting there
            spans = sorted(
                (at[2], math.prod(at[1]) * fmt.DTYPE_SIZES[at[0]], name)
                for name, at in self._specs.items()
            )
            self._by_start = [start for start, _, _ in spans], spans
        starts, spans = self._by_start
        offset = src.storage_offset() * src.element_size()
        start, size, name = spans[bisect.bisect_right(starts, offset) - 1]
        assert start <= offset <= start + size
        return name


class _Asked(Mapping[str, torch.Tensor]):
    """The values to hand over in the first plan: each name's tensor of its own."""

    def __init__(self, own: Callable[[str], torch.Tensor], names: Mapping[str, Any]) -> None:
        self._own = own
        self._names = names

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._own(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _Handed(Mapping[str, torch.Tensor]):
    """The tensors of their own, handed over: each the first time, a clone after."""

    def __init__(self, own: dict[str, torch.Tensor]) -> None:
        self._own = own
        self._given: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._given:
            return self._own[name].clone()
        self._given.add(name)
        return self._own[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._own)

    def __len__(self) -> int:
        return len(self._own)


def check_keys(keys: Any) -> tuple[str, ...] | None:
    """``load(keys=...)``: None, a key path, or an iterable of them (non-empty str each, no
    leading or trailing "/")."""
    if keys is None:
        return None
    if isinstance(keys, str):
        keys = [keys]
    try:
        out = tuple(keys)
    except TypeError:
        raise TypeError(f"keys must be a str or an iterable of str, not {keys!r}") from None
    for k in out:
        if not isinstance(k, str) or not k or k.startswith("/") or k.endswith("/"):
            raise ValueError(f"keys must be key paths like 'model' or 'model/layers.3', not {k!r}")
    if not out:
        raise ValueError("keys is empty: give the key paths to load, or None for all")
    return out


def target_paths(into: Any) -> tuple[str, ...] | None:
    """The key paths of everything ``into`` holds (its dicts walked, anything else a leaf);
    None when ``into`` is not a dict (then all is read)."""
    if not isinstance(into, dict):
        return None
    paths: list[str] = []
    stack: list[tuple[str, Any]] = [("", into)]
    while stack:
        prefix, mapping = stack.pop()
        for k, v in mapping.items():
            path = f"{prefix}/{k}" if prefix else str(k)
            if isinstance(v, dict) and v and not is_stateful(v):
                stack.append((path, v))
            else:
                paths.append(path)
    return tuple(paths) if paths else None


def init_optimizer_states(into: Any) -> None:
    """Give each optimizer in ``into`` (at the top or in its dicts and lists) whose parameters
    include DTensors and whose state is still empty its state, as one step with zero
    gradients and a learning rate of 0 would: restoring needs DTensor moments to restore
    into (load_state_dict of a fresh optimizer would take the saved moments as plain tensors,
    which FSDP2's step then refuses). An optimizer with state, or with gradients already, is
    left alone. Without DTensors imported no optimizer has one, and nothing is walked."""
    if _dtensor_type() is None:
        return
    optimizer, containers = torch.optim.Optimizer, (dict, list, tuple)
    stack, seen = [into], set()
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, optimizer):
            _init_state(value)
        elif isinstance(value, containers):
            # Only what may hold an optimizer is walked on: 20k tensors cost 15-20 ms else.
            values = value.values() if isinstance(value, dict) else value
            stack.extend(v for v in values if isinstance(v, (optimizer, *containers)))


def _init_state(opt: torch.optim.Optimizer) -> None:
    dtensor_type = _dtensor_type()
    params = [p for group in opt.param_groups for p in group["params"]]
    if (
        opt.state
        or dtensor_type is None
        or not any(isinstance(p, dtensor_type) for p in params)
        or any(p.grad is not None for p in params)
    ):
        return
    lrs = [group.get("lr") for group in opt.param_groups]
    try:
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        for group in opt.param_groups:
            if "lr" in group:
                lr = group["lr"]
                group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        opt.step()
    finally:
        for group, lr in zip(opt.param_groups, lrs, strict=True):
            if lr is not None:
                group["lr"] = lr
        opt.zero_grad(set_to_none=True)


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidStepError(f"step must be a non-negative int or None, not {step!r}")


def map_loaded(
    reply: LoadReply, later: list[tuple[torch.Tensor, torch.Tensor]] | None = None
) -> dict[str, torch.Tensor]:
    """Map the daemon's load segment and view each tensor in it (no copy); ``later`` as in
    views (the daemon may still be reading into it)."""
    name, size = reply.segment, reply.size
    assert name is not None
    fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
    try:
        mm = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
        _posixshmem.shm_unlink(name)  # the mapping lives on as long as the tensors do
    u8 = torch.frombuffer(mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    return views(u8, reply.tensors, later)


class _Later(Mapping[str, torch.Tensor]):
    """The values a restore planned before the bytes are read hands over: a tensor of its own
    for each, paired in ``later`` with the view it is filled from once they are in."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], later: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self._tensors = tensors
        self._later = later

    def __getitem__(self, name: str) -> torch.Tensor:
        src = self._tensors[name]
        own = torch.empty_like(src)
        self._later.append((own, src))
        return own

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


@no_gc
def views(
    u8: torch.Tensor,
    specs: dict[str, TensorAt],
    later: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Each loaded tensor as a view of the bytes the daemon read.

    Tensors of one dtype that follow one another are cut from one typed view by a single
    split_with_sizes (see typed_views): at 20k tensors, a slice and two views per tensor
    took 70-120 ms. With
    ``later``, the bytes are not read yet: a tensor that gets memory of its own (see below)
    is left empty, paired there with the view it is to be filled from.
    """
    tensors: dict[str, torch.Tensor] = {}
    by_offset = sorted(specs.items(), key=lambda item: item[1][2])
    cuts = []
    for key, (dtype_name, shape, start) in by_offset:
        itemsize = fmt.DTYPE_SIZES[dtype_name]
        if start % itemsize:
            raise CorruptCheckpointError(f"tensor {key!r} is not aligned to its item size", key=key)
        cuts.append((ST_TO_TORCH[dtype_name], shape, start, math.prod(shape) * itemsize))
    for (name, (dtype_name, shape, _)), part in zip(by_offset, typed_views(u8, cuts), strict=True):
        if dtype_name == "U8" and len(shape) == 1 and part.numel() <= _RNG_STATE_BYTES:
            part = _own_memory(part, later)
        tensors[name] = part
    return tensors


@no_gc
def image_views(
    layout: Layout, own: list[torch.Tensor], later: list[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The tensors of a load read into a slab as the shard's file has them (LoadReply.image):
    ``own``, the slab's views of ``layout`` in flatten order, by name; what gets memory of
    its own is left empty and paired in ``later`` with its view, as in views."""
    specs = layout.specs
    tensors: dict[str, torch.Tensor] = {}
    for j, part in zip(layout.order, own, strict=True):
        spec = specs[j]
        if spec.dtype == "U8" and len(spec.shape) == 1 and part.numel() <= _RNG_STATE_BYTES:
            part = _own_memory(part, later)
        tensors[spec.name] = part
    return tensors


def _own_memory(
    part: torch.Tensor, later: list[tuple[torch.Tensor, torch.Tensor]] | None
) -> torch.Tensor:
    """``part``, an RNG state likely, in memory of its own: torch.set_rng_state and
    Generator.set_state read the tensor's storage from its start, whatever its offset. With
    ``later`` (the bytes not read yet) it is left empty, paired there with ``part``."""
    if later is None:
        return part.clone()
    own = torch.empty_like(part)
    later.append((own, part))
    return own


#: 1-D byte tensors up to this size come back owning their memory (see views): every torch
#: RNG state is one (the CPU generator's is 5056 bytes), and copying them costs nothing.
_RNG_STATE_BYTES = 64 * 1024
