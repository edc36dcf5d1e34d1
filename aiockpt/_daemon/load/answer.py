"""Loads answered before their bytes are read, collected once they are in (:class:`_Early`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..._core.protocol import LoadReply
from ...errors import (
    CheckpointError,
)
from .plan import _Plan


class _Early:
    """The loads answered before their bytes are read (see LoadReq.early), by name: their
    plan and how to read them until read, then their plan, the bytes read and what failed, until the
    trainer collects them. The reader thread reads them, or waits for a read started ahead,
    once their answers are sent (see Daemon.read_loop): the trainer plans its restore
    meanwhile, so the reply's decoding, the views and the walk of the target no longer come
    after the read.

    A read into a lent slab starts sooner, on a thread of its own, before its answer is built
    and sent: making and pickling the answer's entries is Python work per tensor, and the
    read's requests release the GIL, so the two overlap (see docs/performance.md, "The load
    path, choice by choice"). A read into a new segment still waits for its answer, so that
    the trainer, which maps the segment once it has the name, faults the fresh pages in
    alongside it rather than after it."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[_Plan, Callable[[], int] | Future[int]]] = {}
        self._outcomes: dict[str, tuple[_Plan, int, BaseException | None]] = {}
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="aiockpt-early-read")

    def answer(
        self,
        name: str,
        plan: _Plan,
        read: Callable[[], int],
        segment: str | None = None,
        *,
        ahead: bool = False,
        decide: Callable[[_Plan], _Plan] | None = None,
        **fields: Any,
    ) -> LoadReply:
        """The early answer to load ``name`` (its bytes to be in the slab lent, or in
        ``segment``, with ``fields``): ``read`` reads and verifies them (the bytes read).
        With ``ahead``, the read starts now, and ``decide`` (the plan as the answer tells
        it, see as_image) runs meanwhile."""
        job = self._ahead.submit(read) if ahead else read
        self._pending[name] = (plan, job)
        try:
            if decide is not None:
                plan = decide(plan)
                self._pending[name] = (plan, job)
            return plan.reply(
                segment=segment, tensors=plan.placed(), tree=plan.tree, pending=True, **fields
            )
        except BaseException:
            self.drop()
            raise

    def drop(self) -> None:
        """Forget the loads whose answers could not be sent: a read started ahead is waited
        for (the trainer takes its slab back once it hears of the failure), the others are
        never made."""
        while self._pending:
            _, (_, job) = self._pending.popitem()
            if isinstance(job, Future):
                job.exception()

    def read(self) -> None:
        """Read the loads answered, keeping how each went."""
        while self._pending:
            name, (plan, job) = self._pending.popitem()
            try:
                self._outcomes[name] = (
                    plan,
                    job.result() if isinstance(job, Future) else job(),
                    None,
                )
            except BaseException as e:  # the trainer hears of it when it collects
                self._outcomes[name] = (plan, 0, e)

    def collect(self, name: str) -> LoadReply:
        """The end of load ``name``: its bytes are in, or the error."""
        outcome = self._outcomes.pop(name, None)
        if outcome is None:
            raise CheckpointError(
                f"no load named {name!r} was answered early here (was the daemon restarted?)"
            )
        plan, read, error = outcome
        if error is not None:
            raise error
        return plan.reply(segment=None, tensors={}, tree=None, read_nbytes=read)
