"""Loads the daemon answers before it reads: work done while the bytes come in
(:func:`while_read`), the answer collected (:func:`collected`), a load as new objects
(:func:`load_fresh`)."""

from __future__ import annotations

import dataclasses
import functools
import uuid as uuid_mod
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import torch

from ..._core.gc import gc_paused
from ..._core.protocol import CollectReq, LoadAsk, LoadReply, LoadReq
from .direct import read_direct
from .request import Read
from .restore import unflatten
from .views import map_loaded

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


async def load_fresh(lending: Read, ask: LoadAsk) -> tuple[LoadReply, Any]:
    """Load what ``ask`` names as new objects, in a segment the daemon makes and this
    process takes over.

    The daemon answers before it reads (LoadReq.early): the segment is mapped and the
    values built while it reads, then handed back once every checksum has passed. What
    must own its memory (a generator's state) is filled then. Mapping, viewing and
    rebuilding the tree, work per tensor, thus no longer come after the read.

    When the daemon finds every byte in local files (a local root or tier), it reads nothing
    and says where they are (LoadReq.direct): this process reads them straight into the
    tensors it returns (see read_direct), with no shared memory at all.
    """
    name = uuid_mod.uuid4().hex
    reply = await lending(LoadReq, ask=ask, early=name, direct=True)
    if reply.direct is not None:  # in local files: read here, into tensors of their own
        return reply, await anyio.to_thread.run_sync(_built_direct, reply)
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


def _built_direct(reply: LoadReply) -> Any:
    """The values of a load this process reads itself (see read_direct)."""
    calls: list[Callable[[], object]] = []
    tensors = read_direct(reply)
    with gc_paused():
        built = unflatten(reply.tree, tensors, later=calls)
    for call in calls:
        call()
    return built


async def collected(lending: Read, reply: LoadReply, name: str) -> LoadReply:
    """The outcome of load ``name``, answered early: ``reply`` as if answered late."""
    if not reply.pending:
        return reply
    done = await lending(CollectReq, name=name)
    return dataclasses.replace(reply, read_nbytes=done.read_nbytes, pending=False)
