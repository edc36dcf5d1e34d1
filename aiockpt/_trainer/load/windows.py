"""A load into existing objects a window at a time (``staging_memory``): the windows
fetched in turn (:class:`_Windows`) and the restore planned against placeholders and
carried out window by window (:class:`WindowedRestore`)."""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import anyio
import anyio.lowlevel
import torch

from ..._core import format as fmt
from ..._core.gc import no_gc
from ..._core.protocol import LoadReply, SlabRef, TensorAt
from ..staging import Slab, copy_pairs
from .early import while_read
from .request import Read, Windowed
from .restore import Restored, Target
from .restore_order import plan_restore
from .views import views


class _Windows:
    """The windows of one load (see Loader._windowed), read by the daemon into ``slabs`` in
    turn: each fetched while the one before is copied out, what failed kept to be raised as
    it is (not in a group), the read's failure first."""

    def __init__(
        self, lending: Read, slabs: tuple[Slab, Slab], load: Windowed, reply: LoadReply
    ) -> None:
        self._lending, self._slabs, self._load, self.reply = lending, slabs, load, reply
        self._refs = [SlabRef(slab.name, slab.size) for slab in slabs]
        self.failed: list[Exception] = []
        self.copied = False
        self.read_nbytes = 0  # the bytes the daemon read for this load, every pass

    async def fetch(self, i: int) -> None:
        slab = self._refs[i % 2]
        try:
            kind, fields = self._load.part(self.reply.step, slab, i)
            done = await self._lending(kind, **fields)
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


async def plan_while(
    read: Callable[[], Awaitable[Any]],
    reply: LoadReply,
    target: Target,
) -> tuple[WindowedRestore, Any]:
    """The restore of a load in windows, planned while ``read()`` runs (the checking pass,
    or a streamed load's first window; nothing changes yet), and what ``read`` returned;
    raised, the read's failure first."""
    plan = functools.partial(WindowedRestore, reply, target)
    return await while_read(read, plan)


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
    def __init__(self, reply: LoadReply, target: Target) -> None:
        self._target, self._tree = target, reply.tree
        self._at = {name: at[2] for name, at in reply.tensors.items()}
        whole = torch.empty(reply.size, dtype=torch.uint8, device="meta")
        self._meta = meta = views(whole, reply.tensors)
        #: name -> a tensor of its own, filled from the windows (see class docstring).
        self._own: dict[str, torch.Tensor] = {}
        # What is handed over gets its own tensor at once, not a placeholder: building the
        # values handed over may look at them (a DTensor's local tensor is moved to its
        # device, an array viewed); their bytes come later.
        self._first = first = plan_restore(target, reply.tree, meta, _Asked(self._own_tensor, meta))
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
        # one split, the gaps between them included (a slice each would be Python work per
        # tensor); a span over bytes already cut (a tensor copied whole and also given its
        # own) is sliced.
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
        nothing is handed over): planning again is work per tensor, spared when nothing
        needs it."""
        if self._own:
            sources = {**self._meta, **self._own}
            plan = plan_restore(self._target, self._tree, sources, _Handed(self._own))
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
