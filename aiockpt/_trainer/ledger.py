"""The saves of one manager: the handles it gave out, and which steps are taken."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import anyio
import anyio.lowlevel

from .._core.protocol import CheckpointInfo, SaveDone
from ..errors import CheckpointError, InvalidStepError, StepExistsError


class SaveHandle:
    """The pending commit of one save. ``await handle`` gives its :class:`CheckpointInfo`."""

    def __init__(self, step: int, uuid: str) -> None:
        self.step = step
        self.uuid = uuid
        self._event = anyio.Event()
        #: The event loop of the manager that made it: only that loop can wait on it.
        self._loop = loop_token()
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None
        #: While save() still stages it in windows: a failure is save()'s to raise and report.
        self.staging = False

    def done(self) -> bool:
        """Whether the save has ended: committed or failed."""
        return self._event.is_set()

    def _resolve(
        self, info: CheckpointInfo | None = None, error: BaseException | None = None
    ) -> None:
        if not self._event.is_set():
            self._info, self._error = info, error
            self._event.set()

    def raise_error(self) -> None:
        """Raise the error of a save that failed."""
        if self._error is not None:
            raise self._error

    async def wait(self) -> CheckpointInfo:
        """The committed checkpoint; raises the save's error if it failed."""
        if not self._event.is_set():
            check_loop(self._loop, "a SaveHandle")
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


def loop_token() -> Any:
    """The running event loop (None outside one)."""
    try:
        return anyio.lowlevel.current_token()
    except RuntimeError:
        return None


def check_loop(token: Any, what: str) -> None:
    """Refuse, with a RuntimeError that says what to do, a wait from an event loop other than
    the one ``token`` names: it would never wake (the manager's tasks run on their own loop)."""
    if token is not None and loop_token() != token:
        raise RuntimeError(
            f"{what} is bound to the event loop of the manager that made it, and this is "
            "another one (e.g. a new asyncio.run() per call): it would wait forever. Use the "
            "manager within one event loop, or aiockpt.CheckpointManager from synchronous code"
        )


def check_step_number(step: Any) -> None:
    """Refuse what is not a step number: a non-negative int of at most 12 digits."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidStepError(f"step must be an int, not {type(step).__name__}")
    if step < 0:
        raise InvalidStepError(f"step must be >= 0, not {step}")
    if step >= 10**12:
        raise InvalidStepError(f"step {step} does not fit the 12-digit step directory names")


#: ``emit(name, **fields)``: how the ledger reports a save's end (the manager's dispatcher).
Emit = Callable[..., object]


class Ledger:
    """Which saves are pending and which steps are committed or being saved.

    A save is *in flight* from the moment its step is taken until it ends; it is *pending*
    once its request may have reached the daemon, until the daemon answers or dies.
    """

    def __init__(self, url: str, emit: Emit) -> None:
        self._url = url
        self._emit = emit
        #: Handles of saves sent to the daemon and not yet answered, by uuid.
        self.pending: dict[str, SaveHandle] = {}
        #: Steps being staged or pending: a second save of one is refused.
        self.in_flight: set[int] = set()
        #: Committed steps, as far as this manager has heard.
        self.committed: set[int] = set()

    @property
    def busy(self) -> bool:
        """Whether any save is still staging or pending."""
        return bool(self.pending or self.in_flight)

    def check_step(self, step: Any, *, overwrite: bool = False) -> None:
        """Refuse a step that is not a valid step number, or is taken (being saved; or
        committed, unless ``overwrite``)."""
        check_step_number(step)
        if step in self.committed and not overwrite:
            raise StepExistsError(
                f"step {step} is already committed in {self._url} (overwrite=True replaces it)"
            )
        if step in self.in_flight:
            raise StepExistsError(f"step {step} is already being saved")

    def save_done(self, msg: SaveDone) -> None:
        """The daemon's answer to a save: resolve its handle and record the commit."""
        handle = self.pending.pop(msg.uuid, None)
        if handle is None:
            return
        self.in_flight.discard(handle.step)
        if handle.staging:  # failed while save() was staging it: save() raises the error
            handle._resolve(msg.info, msg.error)
            return
        if msg.info is not None:
            self.committed.add(handle.step)
            self.committed.difference_update(msg.deleted)
        if msg.error is not None and msg.info is None:
            self._emit("save.exception", uuid=handle.uuid, step=handle.step, error=msg.error)
        else:
            self._emit(
                "save.end",
                uuid=handle.uuid,
                step=handle.step,
                nbytes=msg.info.nbytes if msg.info else None,
            )
        handle._resolve(msg.info, msg.error)

    def fail(self, handle: SaveHandle, err: BaseException) -> None:
        """End a save with ``err``."""
        self.pending.pop(handle.uuid, None)
        self.in_flight.discard(handle.step)
        self._emit("save.exception", uuid=handle.uuid, step=handle.step, error=err)
        handle._resolve(error=err)

    async def settle(self) -> None:
        """Wait until every save pending now has ended, however it ended."""
        for handle in list(self.pending.values()):
            with contextlib.suppress(Exception):
                await handle.wait()

    async def wait(self) -> None:
        """Wait until every save pending now has ended; raise the first failure."""
        first: BaseException | None = None
        for handle in list(self.pending.values()):
            try:
                await handle.wait()
            except CheckpointError as e:
                first = first or e
        if first is not None:
            raise first
